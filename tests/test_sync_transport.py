"""The sync's file as transport: in RAM by default, a fallback to disk that says why, fsync only
for checkpoints asked to be durable, one pass of the writer over each tensor, and nothing left
behind that an engine would read when a writer or a sync fails."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import ENGINE_KWARGS, TinyLM, trainer

import weight_bridge.checkpoint.space as space
import weight_bridge.sync.retention as retention
from callbacks import CheckpointFiles, EngineSpec, Schedule, VLLMWeightSync
from weight_bridge.checkpoint import (
    CheckpointReader,
    CheckpointWriteError,
    CheckpointWriter,
    save_checkpoint,
)
from weight_bridge.checkpoint.format import HASH_KEY
from weight_bridge.checkpoint.mapping import TransportMaps
from weight_bridge.checkpoint.write import CHUNK_BYTES
from weight_bridge.sync.retention import estimate_bytes, place

EVERY_STEP = Schedule(every_n_train_steps=1)


def _step_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("step-*.safetensors"))


class _FsyncSpy:
    """A spy on ``os.fsync`` (records the path of each fd, then really fsyncs): it injects no
    fault, it only shows which files were made durable."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        real = os.fsync

        def spy(fd: int) -> None:
            self.paths.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        monkeypatch.setattr(os, "fsync", spy)


# -- where the files go ------------------------------------------------------------------------


def test_default_placement_is_ram_when_the_callback_builds_the_engine(tmp_path: Path) -> None:
    where = place(CheckpointFiles(), str(tmp_path), 1 << 20, builds_engine=True)
    assert where.in_ram and where.fallback is None
    assert where.directory.parent == retention.RAM_ROOT
    # a given engine reading from a disk root, a dirpath, ram_dir=False or durable: disk
    assert place(CheckpointFiles(), str(tmp_path), 1, False, str(tmp_path)).in_ram is False
    for files in (
        CheckpointFiles(dirpath=str(tmp_path / "d")),
        CheckpointFiles(ram_dir=False),
        CheckpointFiles(durable=True),
    ):
        where = place(files, str(tmp_path), 1, builds_engine=True)
        assert not where.in_ram and where.fallback is None
    assert place(CheckpointFiles(dirpath="x"), str(tmp_path), 1, True).directory == Path("x")
    with pytest.raises(ValueError, match="durable"):
        CheckpointFiles(ram_dir=True, durable=True)


def test_fallback_to_disk_names_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need = 100 * 2**20
    small = place(CheckpointFiles(), str(tmp_path), need, True, free=lambda p: 150 * 2**20)
    assert not small.in_ram and small.directory == tmp_path / "weight_sync"
    # the newest file, the one being written, and the complete base a partial chain rests on
    assert "150 MiB free" in small.fallback and "3 checkpoints of 100 MiB" in small.fallback
    complete_only = place(
        CheckpointFiles(), str(tmp_path), need, True, free=lambda p: 150 * 2**20, partial=False
    )
    assert "2 checkpoints of 100 MiB" in str(complete_only.fallback)
    fits = place(
        CheckpointFiles(), str(tmp_path), need, True, free=lambda p: 3 * need + 2**27, partial=True
    )
    assert fits.in_ram
    kept = place(CheckpointFiles(keep_last_k=3), str(tmp_path), need, True, free=lambda p: 1 << 40)
    assert kept.in_ram  # room enough
    monkeypatch.setattr(retention, "RAM_ROOT", tmp_path / "no-shm")
    missing = place(CheckpointFiles(), str(tmp_path), need, builds_engine=True)
    assert not missing.in_ram and "no-shm does not exist" in missing.fallback


def test_estimate_counts_tied_tensors_once_and_the_cast() -> None:
    w = torch.zeros(4, 8)
    state = {"a": w, "tied": w, "b": torch.zeros(3, dtype=torch.int64)}
    assert estimate_bytes(state) == 4 * 8 * 4 + 3 * 8
    assert estimate_bytes(state, torch.bfloat16) == 4 * 8 * 2 + 3 * 8


# -- a real Trainer: RAM by default, fallback, durable ---------------------------------------


@pytest.mark.slow
def test_default_sync_is_in_ram_holds_only_what_it_needs_and_is_released(
    models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defaults: the transport in ``/dev/shm``, where host memory carries every byte, so
    ``delta="auto"`` sends full syncs (each record says why) and keeps no reference copy. The
    directory holds the served file, a spare and nothing else, and goes at teardown with the
    engine."""
    fsynced = _FsyncSpy(monkeypatch)
    held: list[list[str]] = []
    recycled: list[bool] = []
    hashed: list[bool] = []
    kept_maps: list[int] = []
    references: list[int] = []

    class Watch(VLLMWeightSync):
        def _sync(self, trainer, pl_module, step):
            spare = self._dir / ".spare"
            before = spare.stat().st_ino if spare.exists() else None
            super()._sync(trainer, pl_module, step)
            held.append(sorted(os.listdir(self._dir)))
            with CheckpointReader(self.last_checkpoint) as reader:
                hashed.append(HASH_KEY in reader.metadata)
            recycled.append(before == (self._dir / f"step-{step:08d}.safetensors").stat().st_ino)
            self.maps = self.gatherer.maps
            kept_maps.append(len(self.maps))
            references.append(self.deltas.reference.nbytes)

    sync = Watch(
        engine=EngineSpec(model=str(models["llama_A"]), options={"engine_args": ENGINE_KWARGS}),
        schedule=EVERY_STEP,
    )
    module = TinyLM(str(models["llama_A"]))
    trainer(tmp_path, [sync], max_steps=3).fit(module)
    directory = Path(sync.last_checkpoint).parent
    assert directory.parent == Path("/dev/shm") and directory.name.startswith("weight_bridge-")
    assert [h["step"] for h in sync.history] == [0, 1, 2, 3]
    assert sync.schedule.delta == "auto" and not any(h["delta"] for h in sync.history)
    choices = [h["choice"] for h in sync.history]
    assert choices[0]["why"].startswith("the engine reported no dtypes yet")
    for choice in choices[1:]:  # the engine accepts deltas; the transport makes them dearer
        assert choice["sent"] == "full" and choice["why"].startswith("host memory carries")
    assert references == [0] * 4  # no reference copy: nothing will be diffed against it
    # the served file and a spare: made after the first sync, then the previous file (the run
    # holds the directory through its owner file)
    assert held == [[".owner", ".spare", f"step-0000000{s}.safetensors"] for s in (0, 1, 2, 3)]
    assert recycled == [False, True, True, True]  # its pages reused by the next write
    assert kept_maps == [2, 2, 2, 2]  # the writer's map of each of the two files, kept
    assert hashed == [False] * 4  # transport: no hash unless the engine is to check it
    assert fsynced.paths == []  # transport: nothing fsynced
    assert not directory.exists()  # released at teardown, with the engine it built
    assert len(sync.maps) == 0 and sync.gatherer.maps is None  # and the writer's maps of it


@pytest.mark.slow
def test_too_little_ram_falls_back_to_the_log_dir_with_a_warning(
    models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(retention, "free_bytes", lambda path: 2**20)  # /dev/shm "has 1 MiB"
    sync = VLLMWeightSync(
        engine=EngineSpec(model=str(models["llama_A"]), options={"engine_args": ENGINE_KWARGS}),
        schedule=EVERY_STEP,
    )
    with pytest.warns(UserWarning, match=r"not to RAM: /dev/shm has 1 MiB free"):
        trainer(tmp_path, [sync], max_steps=1).fit(TinyLM(str(models["llama_A"])))
    assert Path(sync.last_checkpoint).parent == tmp_path / "weight_sync"
    assert _step_files(tmp_path / "weight_sync") == [
        "step-00000000.safetensors",
        "step-00000001.safetensors",
    ]  # on disk: keep_last_k defaults to 2


def test_durable_checkpoints_are_fsynced_and_transport_ones_are_not(
    models, shared_engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = shared_engine("llama_A")
    for durable in (True, False):
        out = tmp_path / f"ws-{durable}"
        fsynced = _FsyncSpy(monkeypatch)
        files = CheckpointFiles(dirpath=str(out), durable=durable)
        sync = VLLMWeightSync(engine=engine, files=files, schedule=EVERY_STEP)
        trainer(tmp_path / str(durable), [sync], max_steps=2).fit(TinyLM(str(models["llama_A"])))
        with CheckpointReader(sync.last_checkpoint) as reader:
            reader.verify_hash()  # on disk a checkpoint always carries its hash
        temps = [p for p in fsynced.paths if Path(p).name.endswith(".tmp")]
        dirs = [p for p in fsynced.paths if p == str(out)]
        if durable:  # each step's file (while a temporary) and the directory after its rename
            assert len(temps) == 3 and len(dirs) == 3, fsynced.paths
            for p in temps:
                assert Path(p).parent == out and Path(p).name.startswith(".step-0000000")
        else:
            assert fsynced.paths == []
        monkeypatch.undo()


def test_a_failed_push_leaves_no_file_and_the_engine_on_its_version(
    models, shared_engine, tmp_path: Path
) -> None:
    """A real fault: a NaN in the trainer's weights at step 2, which the engine refuses."""
    engine = shared_engine("llama_A")

    def poisoned_at_step_2(m) -> dict:
        state = dict(m.model.state_dict())
        if m.trainer.global_step == 2:
            state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], float("nan"))
        return state

    out = tmp_path / "ws"
    sync = VLLMWeightSync(
        engine=engine,
        source=poisoned_at_step_2,
        files=CheckpointFiles(dirpath=str(out), keep_last_k=10),
        schedule=EVERY_STEP,
        on_error="warn",
    )
    with pytest.warns(UserWarning, match="push of step 2 failed, the engine stays on version 1"):
        trainer(tmp_path, [sync], max_steps=2).fit(TinyLM(str(models["llama_A"])))
    assert engine.version == 1
    assert _step_files(out) == ["step-00000000.safetensors", "step-00000001.safetensors"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


# -- the writer: one pass, reserved up front, killed mid-file --------------------------------


def test_cast_in_the_writer_equals_a_cast_before_it(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(CHUNK_BYTES // 4 * 3 + 5, generator=g)  # several chunks and a remainder
    strided = torch.randn(64, 48, generator=g).t()  # not contiguous
    ts = {"big": big, "strided": strided, "empty": torch.zeros(0)}
    want = save_checkpoint(
        {k: v.to(torch.bfloat16) for k, v in ts.items()}, tmp_path / "a.safetensors", fsync=False
    )
    specs = {k: torch.empty(v.shape, dtype=torch.bfloat16, device="meta") for k, v in ts.items()}
    with CheckpointWriter(tmp_path / "b.safetensors", specs, fsync=False) as writer:
        for name, t in ts.items():
            writer.write(name, t, cast=True)
        got = writer.finish()
    assert got.hash == want.hash
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    with CheckpointReader(got.path) as reader:
        reader.verify_hash()
    writer = CheckpointWriter(tmp_path / "c.safetensors", specs)
    with pytest.raises(Exception, match="does not match the header"):
        writer.write("big", big)  # without cast=True the dtype must match
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_filesystem_without_room_refuses_before_the_first_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mock of the reservation's answer (ENOSPC; a real full tmpfs is in test_checkpoint's
    mount-namespace test): the writer fails at construction, leaving no temporary file."""

    def full(fd: int, mode: int, offset: int, length: int) -> int:
        import ctypes

        ctypes.set_errno(28)
        return -1

    monkeypatch.setattr(space, "_libc_fallocate", lambda: full)
    specs = {"w": torch.empty(1024, 1024, device="meta")}
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        CheckpointWriter(tmp_path / "c.safetensors", specs)
    assert list(tmp_path.iterdir()) == []


WRITER = textwrap.dedent(
    """
    import sys, torch
    from weight_bridge.checkpoint import save_checkpoint
    tensors = {f"t{i}": torch.full((1024, 1024), float(i)) for i in range(48)}
    step = 0
    while True:
        save_checkpoint(tensors, sys.argv[1] + f"/step-{step:08d}.safetensors", fsync=False)
        print(step, flush=True)
        step += 1
    """
)


@pytest.mark.timeout(300)
def test_a_writer_killed_mid_file_in_ram_leaves_nothing_an_engine_would_read(
    tmp_path: Path,
) -> None:
    """SIGKILL while the transport file (in /dev/shm, not fsynced) is half-written: every
    ``step-*.safetensors`` there is whole (its hash verifies), and the half-written file is
    a hidden temporary, which no reader or glob of the callback picks up."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    directory = Path(os.path.realpath(shm)) / f"wb-test-{os.getpid()}"
    directory.mkdir(mode=0o700)
    total = 48 * 2**22
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "0"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # kill while a temporary file is part-written
            temps = [p for p in directory.iterdir() if p.name.endswith(".tmp")]
            sizes = [p.stat().st_size for p in temps if p.exists()]
            if sizes and total // 4 < sizes[0] < 3 * total // 4:
                break
            time.sleep(0.001)
        else:
            pytest.fail("never saw a part-written temporary file")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = sorted(directory.iterdir())
        temps = [p for p in left if p.name.endswith(".tmp")]
        assert len(temps) == 1 and temps[0].name.startswith(".step-")
        assert 0 < temps[0].stat().st_size < total + 4096  # really cut mid-file
        assert stat.S_IMODE(temps[0].stat().st_mode) == 0o600
        finals = _step_files(directory)
        assert finals
        for name in finals:
            with CheckpointReader(directory / name) as reader:
                reader.verify_hash()
                assert len(reader.specs()) == 48
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in directory.iterdir():
            p.unlink()
        directory.rmdir()


MAPPED_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch
    from pathlib import Path
    from weight_bridge.checkpoint import CheckpointWriter
    from weight_bridge.checkpoint.mapping import TransportMaps
    directory = Path(sys.argv[1])
    spare, maps = directory / ".spare", TransportMaps()
    tensors = {f"t{i}": torch.full((1024, 1024), float(i)) for i in range(48)}
    for step in range(3):
        path = directory / f"step-{step:08d}.safetensors"
        with CheckpointWriter(path, tensors, fsync=False, reuse=spare, maps=maps) as writer:
            for i, (name, t) in enumerate(tensors.items()):
                if step == 2 and i == 24:  # the recycled file, through its kept map
                    print("half", flush=True)
                    time.sleep(600)
                writer.write(name, t)
            writer.finish()
        if step:  # what prune does with the file no engine needs any more
            os.rename(directory / f"step-{step - 1:08d}.safetensors", spare)
        print(step, flush=True)
    """
)


@pytest.mark.timeout(300)
def test_a_writer_killed_mid_file_through_its_kept_map_leaves_nothing_an_engine_would_read(
    tmp_path: Path,
) -> None:
    """SIGKILL half-way through the third file, a recycled one written through the map kept
    from its first write: the file before it is whole and the half-written one is a hidden
    temporary (the spare was renamed to it before the first byte)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    directory = Path(os.path.realpath(shm)) / f"wb-test-mapped-{os.getpid()}"
    directory.mkdir(mode=0o700)
    proc = subprocess.Popen(
        [sys.executable, "-c", MAPPED_WRITER, str(directory)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert [proc.stdout.readline().strip() for _ in range(3)] == ["0", "1", "half"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = sorted(p.name for p in directory.iterdir())
        assert len(left) == 2 and left[0].startswith(".step-00000002.") and left[0].endswith(".tmp")
        assert left[1] == "step-00000001.safetensors"
        with CheckpointReader(directory / left[1]) as reader:
            reader.verify_hash()
            assert all(torch.all(t == float(n[1:])) for n, t in reader.tensors())
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_spare_file_is_overwritten_in_place_and_an_odd_one_is_not(tmp_path: Path) -> None:
    ts = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.ones(7, 5)}
    spare = tmp_path / ".spare"
    first = save_checkpoint({"old": torch.zeros(50_000)}, tmp_path / "old.safetensors")
    os.rename(first.path, spare)  # what prune does with a transport file no engine needs
    inode = spare.stat().st_ino
    with CheckpointWriter(tmp_path / "new.safetensors", ts, hashed=False, reuse=spare) as w:
        for name, t in ts.items():
            w.write(name, t)
        saved = w.finish()
    assert not spare.exists() and saved.path.stat().st_ino == inode  # the same pages
    (n,) = struct.unpack("<Q", saved.path.read_bytes()[:8])
    assert saved.path.stat().st_size == 8 + n + saved.bytes  # the longer spare was cut
    with CheckpointReader(saved.path) as reader:
        assert {n: t.clone() for n, t in reader.tensors()}.keys() == ts.keys()
        assert torch.equal(reader.tensor("a"), ts["a"]) and torch.equal(reader.tensor("b"), ts["b"])
        assert "weight_bridge.blake3" not in reader.metadata  # hashed=False: no hash at all
        with pytest.raises(Exception, match="no content hash"):
            reader.verify_hash()
    assert [p.name for p in tmp_path.iterdir()] == ["new.safetensors"]
    # a file we may not reuse (readable by others, or a link): left alone, a new file is made
    odd = tmp_path / ".odd"
    odd.write_bytes(b"x" * 100)
    odd.chmod(0o644)
    link = tmp_path / ".link"
    link.symlink_to(saved.path)
    for other in (odd, link):
        with CheckpointWriter(tmp_path / "n2.safetensors", ts, reuse=other) as w:
            for name, t in ts.items():
                w.write(name, t)
            again = w.finish()
        assert other.is_symlink() or other.read_bytes() == b"x" * 100
        assert again.path.stat().st_ino not in (odd.stat().st_ino, saved.path.stat().st_ino)


def _write(path: Path, ts: dict, dtype: torch.dtype, hashed: bool, **kw) -> None:
    specs = {
        k: torch.empty(v.shape, dtype=dtype if v.is_floating_point() else v.dtype, device="meta")
        for k, v in ts.items()
    }
    with CheckpointWriter(path, specs, fsync=False, hashed=hashed, **kw) as w:
        for name, t in ts.items():
            w.write(name, t, cast=True)
        w.finish()


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_write_through_the_kept_map_stores_the_same_bytes_without_faulting_again(
    tmp_path: Path,
) -> None:
    """The RAM transport's writer copies into a shared map of the file that it keeps from one
    sync to the next: the bytes are those of a plain ``write()`` (cast, hash, odd tensors), and
    a recycled file's second write through its kept map takes (almost) no page fault, where the
    first, through a new map, faults all over it."""
    g = torch.Generator().manual_seed(0)
    ts = {
        "big": torch.randn(CHUNK_BYTES // 4 * 3 + 5, generator=g),  # chunks and a remainder
        "strided": torch.randn(64, 48, generator=g).t(),  # not contiguous
        "ints": torch.arange(10),
        "empty": torch.zeros(0),
    }
    maps = TransportMaps()
    spare = tmp_path / ".spare"
    for dtype in (torch.float32, torch.bfloat16):
        for hashed in (False, True):
            _write(tmp_path / "plain.safetensors", ts, dtype, hashed)
            _write(tmp_path / "mapped.safetensors", ts, dtype, hashed, reuse=spare, maps=maps)
            plain, mapped = tmp_path / "plain.safetensors", tmp_path / "mapped.safetensors"
            assert plain.read_bytes() == mapped.read_bytes(), (dtype, hashed)
            os.rename(mapped, spare)  # what prune does: the next write recycles it
    assert len(maps) == 1  # one file, its map kept

    pages = 32 * 2**20 // 4096
    big = {"w": torch.randn(pages * 1024, generator=g)}
    faults = []
    for _ in range(2):
        before = _minor_faults()
        _write(tmp_path / "mapped.safetensors", big, torch.float32, False, reuse=spare, maps=maps)
        faults.append(_minor_faults() - before)
        os.rename(tmp_path / "mapped.safetensors", spare)
    # the first write needs a longer map (a new one: faults all over it), the second reuses it
    assert faults[0] > pages // 8 and faults[1] < faults[0] // 10, faults
    assert len(maps) == 1
    maps.close()
    assert len(maps) == 0


def _mapped_deleted(path: Path) -> bool:
    """Whether this process still maps the deleted file ``path`` (``/proc/self/maps``)."""
    return f"{path} (deleted)" in Path("/proc/self/maps").read_text()


def test_a_kept_map_goes_with_its_file_and_an_unreserved_file_is_not_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deleted file's map is dropped (its RAM is given back, not held by the trainer);
    a file whose space could not be reserved is written, never mapped (a write through a map
    cannot report a full filesystem: it would kill the process)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    directory = shm / f"wb-maps-{os.getpid()}"
    directory.mkdir(mode=0o700)
    try:
        maps = TransportMaps()
        ts = {"w": torch.randn(16 * 2**20)}  # 64 MiB
        _write(directory / "a.safetensors", ts, torch.float32, False, maps=maps)
        assert len(maps) == 1
        (directory / "a.safetensors").unlink()
        # Per process, not /dev/shm's usage (other test workers write there too): a deleted
        # tmpfs file's pages go back once nothing maps it, so the trainer's map must go.
        assert _mapped_deleted(directory / "a.safetensors")
        maps.drop_unlinked()
        assert len(maps) == 0
        assert not _mapped_deleted(directory / "a.safetensors")  # the pages went with the map

        monkeypatch.setattr(space, "_libc_fallocate", lambda: None)  # no fallocate here
        _write(directory / "b.safetensors", ts, torch.float32, False, maps=maps)
        assert len(maps) == 0
        with CheckpointReader(directory / "b.safetensors") as reader:
            assert torch.equal(reader.tensor("w"), ts["w"])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- vLLM's trainer API: the same writer's names, retention and default version ----------------


class _FakeBridge:
    """A client of the bridge (it has ``push``), recorded; the engine it stands for serves the
    last complete checkpoint and the partial ones pushed on top of it, and answers that chain
    and the label it stamped in the report, as the engine core does."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.served: list[str] = []

    def push(self, checkpoint, version=None, inflight="default"):
        from weight_bridge.checkpoint import BASE_VERSION_KEY, version_of
        from weight_bridge.vllm.report import PushReport

        self.calls.append(("push", str(checkpoint), version, inflight))
        with CheckpointReader(checkpoint) as reader:
            partial = BASE_VERSION_KEY in reader.metadata
            label = version if version is not None else version_of(str(checkpoint), None)
        self.served = [*self.served, str(checkpoint)] if partial else [str(checkpoint)]
        return PushReport(checkpoint=str(checkpoint), version=label, served=list(self.served))


def test_the_trainer_api_names_prunes_and_labels_like_the_callback(tmp_path: Path) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource

    from weight_bridge.checkpoint import BASE_VERSION_KEY
    from weight_bridge.checkpoint.format import VERSION_KEY
    from weight_bridge.vllm.clients.trainer_api import (
        WeightBridgeTrainer,
        WeightBridgeTrainerInitInfo,
    )

    client = _FakeBridge()
    info = WeightBridgeTrainerInitInfo(directory=str(tmp_path), keep_last_k=1, rank=0)
    sender = WeightBridgeTrainer.trainer_init(
        info, client=client, source=ModuleSource(torch.nn.Linear(4, 2))
    )
    for _ in range(3):  # no version: none in the file or the update; the file name is the label
        path = sender.send_weights()
    assert path == tmp_path / "step-00000003.safetensors"
    assert _step_files(tmp_path) == ["step-00000003.safetensors"]  # keep_last_k=1
    assert client.calls[-1] == ("push", str(path), None, None)  # the one push routine, no pause
    assert sender.last_report is not None and sender.last_report.served == [str(path)]
    assert sender.last_version == "step-00000003"
    with CheckpointReader(path) as reader:
        assert VERSION_KEY not in reader.metadata
    part = sender.send_weights(names=["bias"])  # on top of the label the engine stamped
    with CheckpointReader(part) as reader:
        assert reader.metadata[BASE_VERSION_KEY] == "step-00000003"
        assert list(reader.specs()) == ["bias"]
    # the complete file the engine serves under the partial one is kept, beyond keep_last_k
    assert _step_files(tmp_path) == ["step-00000003.safetensors", "step-00000004.safetensors"]
    named = sender.send_weights(version="v5")
    assert client.calls[-1] == ("push", str(named), "v5", None)
    with CheckpointReader(named) as reader:
        assert reader.metadata[VERSION_KEY] == "v5"
    assert sender.last_version == "v5"
    assert _step_files(tmp_path) == ["step-00000005.safetensors"]


def test_the_trainer_api_refuses_by_name_a_client_it_cannot_push_through() -> None:
    """vLLM's Ray client (or any four-method client) carries no outcome of the update: refused
    at ``trainer_init``, naming it and what to pass instead; vLLM's HTTP client becomes the
    bridge's HTTP client on its URL, with no pause."""
    from vllm.distributed.weight_transfer.clients import (
        HTTPVLLMWeightSyncClient,
        RayVLLMWeightSyncClient,
    )

    from weight_bridge.vllm.clients.http import HTTPClient
    from weight_bridge.vllm.clients.trainer_api import bridge_client_of

    for client, name in (
        (RayVLLMWeightSyncClient(object()), "RayVLLMWeightSyncClient"),
        (object(), "object"),
    ):
        with pytest.raises(TypeError, match=name) as refused:
            bridge_client_of(client)
        assert "HTTPVLLMWeightSyncClient(url)" in str(refused.value)
    bridge = bridge_client_of(HTTPVLLMWeightSyncClient("http://127.0.0.1:9/", timeout=7))
    assert isinstance(bridge, HTTPClient) and bridge.url == "http://127.0.0.1:9"
    assert bridge.inflight is None and bridge.timeout_s == 7
    fake = _FakeBridge()
    assert bridge_client_of(fake) is fake
