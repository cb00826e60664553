"""Which checkpoint paths an engine may read (:func:`trusted_checkpoint`), without an engine:
group- and world-writable files, and directories on the way to them, are refused by name;
an owned, private path under the root passes. ``tests/test_serve.py`` checks the same over
HTTP for a group-writable file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from safetensors.torch import save_file

from weight_bridge.checkpoint import CheckpointError
from weight_bridge.checkpoint.trust import trusted_checkpoint


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A private root holding ``sub/model.safetensors``, every level 0o700/0o600."""
    import torch

    base = tmp_path / "root"
    (base / "sub").mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(base / "sub" / "model.safetensors"))
    base.chmod(0o700)
    (base / "sub").chmod(0o700)
    (base / "sub" / "model.safetensors").chmod(0o600)
    return base


def _refused(path: Path, root: Path | None, *words: str) -> str:
    with pytest.raises(CheckpointError) as info:
        trusted_checkpoint(path, root)
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


def test_a_private_path_under_the_root_passes(root: Path) -> None:
    file = root / "sub" / "model.safetensors"
    assert trusted_checkpoint(file, root) == file.resolve()
    assert trusted_checkpoint("sub", root) == (root / "sub").resolve()  # a directory, relative


@pytest.mark.parametrize("mode", [0o666, 0o646, 0o620])
def test_a_world_or_group_writable_file_is_refused(root: Path, mode: int) -> None:
    file = root / "sub" / "model.safetensors"
    file.chmod(mode)
    _refused(file, root, "the checkpoint file", "writable by its group or by others", f"{mode:04o}")
    _refused(root / "sub", root, "file model.safetensors", "writable")  # as a directory's shard


@pytest.mark.parametrize("mode", [0o777, 0o707, 0o770])
def test_a_world_or_group_writable_directory_on_the_path_is_refused(root: Path, mode: int) -> None:
    (root / "sub").chmod(mode)
    # the file itself is private: the directory on the way to it is what is refused
    _refused(root / "sub" / "model.safetensors", root, "directory", "writable", f"{mode:04o}")
    _refused(root / "sub", root, "the checkpoint directory", "writable")


def test_a_world_writable_root_is_refused_unless_sticky(root: Path) -> None:
    file = root / "sub" / "model.safetensors"
    root.chmod(0o777)
    _refused(file, root, "the checkpoint root", "writable")
    root.chmod(0o1777)  # sticky, as /tmp: no one renames another user's entries
    assert trusted_checkpoint(file, root) == file.resolve()


def test_a_path_leading_out_of_the_root_is_refused(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((root / "sub" / "model.safetensors").read_bytes())
    os.chmod(outside, 0o600)
    (root / "sub" / "link.safetensors").symlink_to(outside)
    _refused(root / "sub" / "link.safetensors", root, "outside the engine's checkpoint root")
    _refused(root / ".." / "outside.safetensors", root, "outside")
    _refused(root / "sub" / "model.safetensors", None, "no checkpoint root")
