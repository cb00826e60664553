"""vLLM's trainer-side ``WeightSource``, read one way on every tested vLLM.

The bridge's trainer (:mod:`~weight_bridge.vllm.clients.trainer_api`) writes *complete* tensors
into one checkpoint on rank 0 (the sender), so from any source it needs the declared tensors,
a stream of full tensors, and, before anything is written, whether rank 0 will get each tensor
whole. The two APIs differ in each:

- **0.32**: ``metadata()`` is a method; the source itself is iterated, yielding full tensors;
  a source that overrides ``held_names()`` holds only those names on this rank (and yields
  None for the others of a group it iterates). Holdings differ per rank, so only the sender
  can check its own.
- **0.33+**: ``metadata`` is a cached property, identical on every rank, ownership included:
  ``ParamMeta.owners`` are the ranks that iterate a tensor (None: every rank), ``placements``
  what ``iter_local()`` yields on each (None: replicated, the whole tensor). ``iter_full()``
  yields, on each rank, the full tensor of each name it owns (gathering a ``DTensor`` among its
  owners); ``iter_local()`` this rank's piece. A source implements one mode or both, and
  ``__iter__`` is gone. As metadata is the same everywhere, every rank finds the same gaps and
  refuses together, before any collective (no rank is left waiting in a gather).

Only public attributes of vLLM's public ``WeightSource`` / ``ParamMeta`` are used; the
"which API" branch lives here so the trainer has one code path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: The trainer rank that writes and pushes (vLLM's ``TrainerInitInfo.is_sender``: rank 0).
SENDER_RANK = 0


def source_metadata(source: Any) -> list[Any]:
    """The ``ParamMeta`` of every tensor of the whole model: ``metadata()`` on 0.32, the
    ``metadata`` property on 0.33+ (read without transferring anything on either)."""
    metadata = source.metadata
    return list(metadata() if callable(metadata) else metadata)


def _implements(source: Any, mode: str) -> bool:
    """Whether a 0.33+ source implements ``iter_full`` / ``iter_local``: vLLM's own
    ``implements_*`` answer on a ``WeightSource`` (the base class defines both modes, raising),
    or the method's presence on a duck-typed one."""
    check = getattr(source, f"implements_{mode}", None)
    if callable(check):
        return bool(check())
    return callable(getattr(source, mode, None))


def _new_api(source: Any) -> bool:
    return hasattr(source, "iter_full") or hasattr(source, "iter_local")


def full_tensors(source: Any) -> Iterator[tuple[str, Any]]:
    """A fresh pass of ``(name, tensor)``, every rank in step (a pass may gather collectively):
    ``iter_full()`` where the source implements it; else ``iter_local()`` (only sent after
    :func:`sender_gaps` found every tensor replicated: each local piece is whole); on 0.32 the
    source's own iteration. A source with none of these is refused by name."""
    if _new_api(source):
        for mode in ("iter_full", "iter_local"):
            if _implements(source, mode):
                return iter(getattr(source, mode)())
    elif hasattr(source, "__iter__"):
        return iter(source)
    raise TypeError(
        f"{type(source).__name__} yields no tensors: a WeightSource implements iter_full() "
        "(vLLM 0.33+) or is iterable (0.32)"
    )


def sender_gaps(source: Any, metas: list[Any], is_sender: bool) -> dict[str, str]:
    """Tensor name -> why rank 0 would not get it whole, of the ``metas`` to be sent.

    0.33+: a tensor whose ``owners`` leave out rank 0 (``iter_full`` yields only owned names,
    and nothing else gathers it onto rank 0); with no ``iter_full``, a tensor with
    ``placements`` (rank 0 would get only its piece from ``iter_local``). Computed from metadata
    alone, so every rank answers the same. 0.32: on the sender, a name ``held_names()`` leaves
    out (elsewhere unknowable: holdings are per rank)."""
    if _new_api(source):
        full = _implements(source, "iter_full")
        gaps = {}
        for m in metas:
            owners = getattr(m, "owners", None)
            placements = getattr(m, "placements", None)
            if owners is not None and SENDER_RANK not in owners:
                gaps[m.name] = (
                    f"owned by trainer ranks {list(owners)} only (ParamMeta.owners), not by "
                    f"rank {SENDER_RANK}, the sender: nothing gathers it onto rank {SENDER_RANK}"
                )
            elif not full and placements is not None:
                gaps[m.name] = (
                    f"rank {SENDER_RANK} holds only its piece ({placements}) and the source has "
                    "no iter_full() to gather the whole tensor"
                )
        return gaps
    held_names = getattr(source, "held_names", None)
    held = held_names() if callable(held_names) and is_sender else None
    if held is None:
        return {}
    held = set(held)
    return {
        m.name: f"not held by rank {SENDER_RANK}, the sender (held_names())"
        for m in metas
        if m.name not in held
    }
