"""The callback's option groups, and the flat keyword form they replace (still accepted).

LightningCLI fills nested dataclasses from nested YAML mappings, so the options are grouped the
way one configures them::

    schedule: {every_n_train_steps: 4, full_every_k: 8}
    files: {dirpath: runs/x/checkpoints, keep_last_k: 2}
    names: {strip_prefix: "model.", dtype: bfloat16}
    canary: {tolerance: 1.0e-3}

The flat keywords of earlier releases (``every_n_train_steps=4``, ``dirpath=...``, ...) are
mapped onto the groups with a :class:`DeprecationWarning`; a flat value equal to its old default
changes nothing (so LightningCLI, which passes every default, leaves the groups alone).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

from .canary import CanaryCheck
from .names import CheckpointNames
from .retention import CheckpointFiles
from .schedule import Schedule

__all__ = ["flat_options", "regroup"]

# flat keyword -> (group, field)
_FLAT: dict[str, tuple[str, str]] = {
    **{f: ("schedule", f) for f in (f.name for f in dataclasses.fields(Schedule))},
    **{f: ("files", f) for f in (f.name for f in dataclasses.fields(CheckpointFiles))},
    **{f: ("names", f) for f in (f.name for f in dataclasses.fields(CheckpointNames))},
    "canary_prompts": ("canary", "prompts"),
    "canary_tolerance": ("canary", "tolerance"),
}


def flat_options(
    every_n_train_steps: int | None = 1,
    at_steps: list[int] | None = None,
    push_on_train_start: bool = True,
    push_on_train_end: bool = True,
    skip_frozen: bool = True,
    full_every_k: int | None = None,
    strip_prefix: str = "",
    rename: dict[str, str] | None = None,
    dtype: str | None = None,
    dirpath: str | None = None,
    ram_dir: bool = False,
    keep_last_k: int = 2,
    node_local: bool = False,
    canary_prompts: list[list[int]] | None = None,
    canary_tolerance: float = 1e-3,
) -> dict[str, Any]:
    """Deprecated flat keywords (see the groups for their meaning); returns those that differ
    from their defaults."""
    given = dict(locals())
    defaults = {k: p.default for k, p in inspect.signature(flat_options).parameters.items()}
    return {k: v for k, v in given.items() if v != defaults[k]}


def regroup(
    flat: dict[str, Any],
    schedule: Schedule,
    files: CheckpointFiles,
    names: CheckpointNames,
    canary: CanaryCheck | None,
) -> tuple[Schedule, CheckpointFiles, CheckpointNames, CanaryCheck | None]:
    """The groups with the flat values applied over them (warning that the form is deprecated)."""
    if not flat:
        return schedule, files, names, canary
    hint = ", ".join(f"{_FLAT[k][0]}.{_FLAT[k][1]}" for k in flat)
    warnings.warn(
        f"VLLMWeightSync: flat arguments {', '.join(flat)} are deprecated; pass them grouped "
        f"({hint}), e.g. schedule=Schedule(every_n_train_steps=4) or, in YAML, "
        "schedule: {every_n_train_steps: 4}",
        DeprecationWarning,
        stacklevel=3,
    )
    changes: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        group, field = _FLAT[key]
        changes.setdefault(group, {})[field] = value
    if "schedule" in changes:
        at = changes["schedule"].get("at_steps")
        if at is not None:
            changes["schedule"]["at_steps"] = tuple(at)
        schedule = dataclasses.replace(schedule, **changes["schedule"])
    if "files" in changes:
        files = dataclasses.replace(files, **changes["files"])
    if "names" in changes:
        names = dataclasses.replace(names, **changes["names"])
    if "canary" in changes and (canary is not None or "prompts" in changes["canary"]):
        canary = dataclasses.replace(canary or CanaryCheck(), **changes["canary"])
    return schedule, files, names, canary
