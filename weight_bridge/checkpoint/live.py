"""A checkpoint made of tensors this process holds: what an engine inside the trainer's own
process (vLLM's external launcher, no engine-core process) is pushed from.

Why: when vLLM runs in the trainer's ranks, its workers share the trainer's memory, so writing
a file and mapping it back is two memory passes the push does not need. The trainer hands the
push a :class:`LiveCheckpoint` (its live parameters, no copy) where a file push hands a path;
the object itself travels in ``update_info`` to the worker (only an engine in this process can
take it: a client of another process refuses it), so every step of an update (validate, plan,
write, read back, the label, the rollback) stays the one a file takes. Nothing outlives the
push: the object is the caller's, referenced only while the update runs.

Nothing here holds the model twice. Each checkpoint tensor is a :class:`LiveTensor`: its name,
shape and dtype (what validation and planning read), the parts this rank holds (a DTensor's
local shard), and how to produce the full tensor. The finiteness check reads, on each rank,
what that rank writes or holds of it (:meth:`LiveTensor.written_parts`: the elements the
engine's loader takes of a plain tensor, where the write map knows them; else its parts), and
the update agrees on every rank's answer. The write pulls them one at a time
(:meth:`LiveCheckpoint.stream`): a sharded tensor is gathered (:mod:`.dtensor`) only when the
engine's loader asks for it, cast to the engine's dtype, checked against its declaration (a
tensor that produces another shape, dtype or device is refused by name: it would be broadcast
or read wrongly), written, and dropped. A rank's extra memory during a push is then about two
full tensors (the one being written and the next being gathered), never the model.

A gather is a collective: every rank must take part in each one, or the others wait. So a
sharded stream agrees before every gather that every rank is ready (the local part of a gather,
its buffer, is allocated first), and a rank whose write stopped (its loader raised, a fault)
answers the next agreement with a stop (:meth:`LiveCheckpoint.end_stream`, which the worker's
transaction calls at the end of every commit): every rank stops at the same tensor, none waits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .dtensor import ShardGather, is_dtensor
from .errors import CheckpointError


@dataclass
class LiveTensor:
    """One checkpoint tensor, produced when the write asks for it: ``sources`` (the trainer's
    tensors, plain or DTensors: not copied), combined by ``merge`` (a LoRA merge; None: the one
    source) and cast to ``dtype``. Shaped like a tensor for what a push reads before writing
    (``shape``, ``dtype``, ``numel()``, ``element_size()``); ``parts`` are what this rank holds
    of its sources (a DTensor's local shard)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: Sequence[torch.Tensor]
    merge: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    parts: list[torch.Tensor] = field(init=False)
    sharded: list[bool] = field(init=False, repr=False)  # which sources are DTensors

    def __post_init__(self) -> None:
        self.shape = tuple(self.shape)
        self.sharded = [is_dtensor(s) for s in self.sources]
        self.parts = [
            s.to_local() if d else s  # type: ignore[attr-defined]
            for s, d in zip(self.sources, self.sharded, strict=True)
        ]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> LiveTensor:
        """A tensor (or a DTensor) as it is pushed: the full one in ``dtype`` (default: its own)."""
        return cls(name, tuple(tensor.shape), dtype or tensor.dtype, [tensor])

    @property
    def gathered(self) -> bool:
        """Whether producing it is a collective (a source is sharded across ranks)."""
        return any(self.sharded)

    def numel(self) -> int:
        return math.prod(self.shape)

    def written_parts(self, copies: Sequence[Any]) -> list[torch.Tensor] | None:
        """The elements of it this rank writes, as views of its one source: ``copies`` are
        the copies the engine's loader takes of the produced tensor (a tensor-parallel narrow, a
        slice of a fused tensor; each with ``src_offset``, ``src_stride``, ``shape`` and
        ``extent`` in the tensor's flat elements: the write map's segments). Only where the
        produced tensor is its source as it is (one plain, contiguous source of the declared
        shape, no merge; a cast keeps every element's place); else None: every part is read."""
        if self.merge is not None or len(self.sources) != 1 or not copies:
            return None
        source = self.sources[0]
        if self.sharded[0] or tuple(source.shape) != self.shape or not source.is_contiguous():
            return None
        numel, base = source.numel(), source.storage_offset()
        if any(c.src_offset < 0 or c.src_offset + c.extent > numel for c in copies):
            return None
        return [source.as_strided(c.shape, c.src_stride, base + c.src_offset) for c in copies]

    def produced_problem(self, tensor: torch.Tensor) -> str | None:
        """Why ``tensor``, produced for it, is not what it declares (shape, dtype, the device
        its parts are on), or None. A write takes a tensor by what it declares: one of another
        shape is broadcast (a row into every row) or read past, and the read-back compares it
        the same way, so it would be accepted."""
        problems = []
        with torch._C.DisableTorchFunction():  # reads of metadata: no mode needs to see them
            shape, dtype, device = tuple(tensor.shape), tensor.dtype, tensor.device
            where = self.parts[0].device if self.parts else device
        if shape != self.shape:
            problems.append(f"shape {list(shape)} (declared {list(self.shape)})")
        if dtype != self.dtype:
            problems.append(f"dtype {dtype} (declared {self.dtype})")
        if not _same_device(device, where):
            problems.append(f"a tensor on {device} (its parts are on {where})")
        if not problems:
            return None
        return "produced " + ", ".join(problems) + ": a tensor must produce what it declares"

    def element_size(self) -> int:
        return self.dtype.itemsize

    def prepare(self) -> Callable[[], torch.Tensor]:
        """The local part (each sharded source's buffer allocated, its shard checked): what can
        fail on this rank alone. The returned call communicates and gives the full tensor."""
        world = torch.distributed.get_world_size() if self.gathered else 1
        gathers = [
            ShardGather(s, range(world)).prepare() if d else s
            for s, d in zip(self.sources, self.sharded, strict=True)
        ]

        def run() -> torch.Tensor:
            full = [g.run() if isinstance(g, ShardGather) else g for g in gathers]
            gathers.clear()
            assert all(t is not None for t in full)  # every rank gathers onto itself
            tensor = self.merge(full) if self.merge is not None else full[0]  # type: ignore[arg-type]
            assert tensor is not None
            return tensor.detach().to(self.dtype)

        return run


Published = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[LiveTensor]


@dataclass
class LiveCheckpoint:
    """Tensors in this process, read like a :class:`~.read.CheckpointReader` (a
    :class:`~.read.CheckpointSource`: ``metadata``, ``tensors()``, ``close()``): its tensors
    are :class:`LiveTensor` descriptions, and :meth:`stream` produces them for the write, one
    at a time. It reads no file (``files`` is empty): there is nothing to hold, hash or
    re-read, and a rollback takes what it wrote back from the pre-images the writer kept."""

    items: list[LiveTensor]
    metadata: dict[str, str] = field(default_factory=dict)
    _ended: bool = False
    _wrong: int = 0  # 1 + the index of the tensor this rank refused as produced (0: none)

    files = ()  # no shard files: PushFailure names no file

    @classmethod
    def of(cls, tensors: Published, metadata: Mapping[str, str] | None = None) -> LiveCheckpoint:
        """``tensors`` (names -> tensors or DTensors, or :class:`LiveTensor` s; not copied)."""
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        items = [t if isinstance(t, LiveTensor) else LiveTensor.of(*t) for t in pairs]
        return cls(items, dict(metadata or {}))

    @property
    def path(self) -> str:
        """Its name in messages, the served chain and reports (for people: nothing reads it)."""
        version = self.metadata.get("version")
        return "tensors in memory" + (f", version {version}" if version is not None else "")

    @property
    def gathered(self) -> bool:
        return any(item.gathered for item in self.items)

    def tensors(self) -> Iterator[tuple[str, LiveTensor]]:
        """Each tensor's description (nothing produced): what a push validates and plans."""
        for item in self.items:
            yield item.name, item

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensors, produced one at a time as the write asks (see the module): every
        rank takes part in each gather of a sharded checkpoint, or every rank stops."""
        gathered = self.gathered
        for index, item in enumerate(self.items):
            run, error = None, None
            try:
                run = item.prepare()
            except Exception as exc:  # this rank alone: the others hear it at the agreement
                error = exc
            if gathered:
                self._agree(error, item.name)
            elif error is not None:
                raise error
            assert run is not None
            tensor = run()
            wrong = item.produced_problem(tensor)
            if wrong is not None:  # mid-write: the writer restores, the update rolls back
                self._wrong = index + 1  # the others hear which, at their next agreement
                raise CheckpointError(self.path, wrong, item.name)
            yield item.name, tensor
            del tensor, run
        if gathered:
            self._agree(None, "")
        self._ended = True

    def end_stream(self) -> None:
        """After a commit, on every rank: a rank whose write stopped before its stream ended
        answers the agreement the others wait in (they stop at the same tensor)."""
        if self.gathered and not self._ended:
            self._ended = True
            _all_ready(False, self._wrong)

    def _agree(self, error: BaseException | None, name: str) -> None:
        ready, wrong = _all_ready(error is None)
        if ready:
            return
        self._ended = True
        if error is not None:
            raise error
        if wrong:  # every rank names the tensor, whichever rank's error the update reports
            why = "another rank refused it as produced (not what it declares): every rank stops"
            raise CheckpointError(self.path, why, self.items[wrong - 1].name)
        raise CheckpointError(
            self.path, "another rank's write stopped: every rank stops at this tensor", name
        )

    def close(self) -> None:
        """The tensors are the caller's: nothing to release."""

    def open_on(self, device: torch.device) -> None:
        """A push opens this source: its stream's state is this push's (the caller's object
        may be pushed again, a retry after a failure: a stale "ended" would leave the other
        ranks waiting in a gather), and every part is materialised on ``device`` (where the
        engine holds its weights): one on the meta device (never materialised) or on another
        device is refused by name, before anything is written (the finiteness check, the
        write and the read-back all read it)."""
        self._ended, self._wrong = False, 0
        for item in self.items:
            for part in item.parts:
                if part.is_meta:
                    raise CheckpointError(
                        self.path,
                        "is on the meta device: it holds no values (not materialised)",
                        item.name,
                    )
                if not _same_device(part.device, device):
                    why = f"is on {part.device}, the engine holds its weights on {device}"
                    raise CheckpointError(self.path, why, item.name)


def _same_device(here: torch.device, there: torch.device) -> bool:
    """Whether two devices are one (``cuda`` is ``cuda:0``)."""
    return here.type == there.type and (here.index or 0) == (there.index or 0)


def _all_ready(ready: bool, wrong: int = 0) -> tuple[bool, int]:
    """Whether every rank of the trainer's world is ready, and which tensor a rank refused as
    produced (``wrong``: 1 + its index, 0 for none; the largest): one all-reduce."""
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor([0 if ready else 1, wrong], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return int(flags[0]) == 0, int(flags[1])
