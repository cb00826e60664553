"""Snapshots of a model: what each module holds, and where every tensor lives.

Two questions are answered by comparing a snapshot with a later one:

* :func:`snapshot_modules` (taken at load, before post-load processing): which modules did
  processing give *derived state* (a tensor or a kernel object a write into the weight does not
  reach)? :mod:`.proof` compares it with the processed model.
* :func:`addresses` (taken before and after every push): did the push move any storage? A
  direct reload must leave every address as it found it (CUDA graphs captured on them).
"""

from __future__ import annotations

import enum
import inspect

import torch

from ..layout import live_tensors, storage_ptr

__all__ = ["Addresses", "ModuleSnapshot", "addresses", "snapshot_module", "snapshot_modules"]

# (kind, identity, storage pointer, version counter, numel) of one attribute of a module
Entry = tuple[str, int, int, int, int]
ModuleSnapshot = dict[str, Entry]
# name -> (data_ptr, shape, stride, dtype name) of every parameter and buffer
Addresses = dict[str, tuple[int, tuple[int, ...], tuple[int, ...], str]]

_PLAIN = (bool, int, float, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)
_SKIP = {"_parameters", "_buffers", "_modules", "training"}


def _entry(value: object) -> Entry | None:
    if isinstance(value, torch.Tensor):
        ptr = storage_ptr(value) if value.device.type != "meta" else 0
        return ("tensor", id(value), ptr, int(value._version), value.numel())
    if isinstance(value, _PLAIN) or value is None:
        return None
    if inspect.isfunction(value) and not value.__closure__:
        return None  # a plain function holds no state of its own
    if inspect.isbuiltin(value) or inspect.isclass(value):
        return None
    return ("object", id(value), 0, 0, 0)


def snapshot_module(module: torch.nn.Module) -> ModuleSnapshot:
    """Identity, storage and version of every tensor and stateful object a module holds."""
    snap: ModuleSnapshot = {}
    for name, p in module._parameters.items():
        if p is not None:
            snap[name] = _entry(p)  # type: ignore[assignment]
    for name, b in module._buffers.items():
        if b is not None:
            snap[name] = _entry(b)  # type: ignore[assignment]
    for name, value in vars(module).items():
        if name in _SKIP or name.startswith("_forward") or name.startswith("_backward"):
            continue
        e = _entry(value)
        if e is not None:
            snap[name] = e
    return snap


def snapshot_modules(model: torch.nn.Module) -> dict[str, ModuleSnapshot]:
    """:func:`snapshot_module` of every module, by qualified name."""
    return {name: snapshot_module(m) for name, m in model.named_modules()}


def addresses(model: torch.nn.Module) -> Addresses:
    """Every parameter and buffer name -> (data_ptr, shape, stride, dtype name)."""
    return {
        name: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
        for name, t, _ in live_tensors(model)
    }
