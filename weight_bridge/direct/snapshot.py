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

from ..layout import storage_ptr

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


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under every name it has (as
    :func:`~weight_bridge.layout.live_tensors`), by walking the modules' own dictionaries.

    Every push walks the model two or three times (the address audit, re-pointing the
    parameters); ``named_parameters`` costs a nested generator per module and name, this a
    plain loop.
    """
    out: dict[str, torch.Tensor] = {}
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        prefix, module = stack.pop()
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    out[prefix + name] = t
        for name, child in module._modules.items():
            if child is not None:
                stack.append((f"{prefix}{name}.", child))
    return out


def addresses(model: torch.nn.Module) -> Addresses:
    """Every parameter and buffer name -> (data_ptr, shape, stride, dtype name)."""
    return addresses_of(named_tensors(model))


def addresses_of(live: dict[str, torch.Tensor]) -> Addresses:
    """:func:`addresses` of tensors already found by :func:`named_tensors`.

    Read with tensor subclasses' ``__torch_function__`` off (vLLM's parameters define one in
    Python, which every attribute read would otherwise go through): the values are the same.
    """
    with torch._C.DisableTorchFunctionSubclass():
        return {
            name: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
            for name, t in live.items()
        }
