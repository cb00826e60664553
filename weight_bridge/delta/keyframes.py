"""When a sync may be a delta, and which dtype each tensor is written in: the keyframe policy.

Both trainer-side writers share it: the Lightning callback (its ``Schedule`` and ``SyncClock``
add the cadence of steps) and ``WeightBridgeTrainer`` (vLLM's trainer API, a clock of sends).
Nothing here knows about files, ranks or engines; each writer feeds it how each sync ended.

* :func:`delta_mode`: the options checked (``delta``, ``full_every_k``, ``delta_budget``).
* :class:`EngineDtypes`: what the engine reported holding each tensor in (``report.dtypes`` of
  its last complete push): the dtype a floating tensor is written in (:func:`castable_dtype`:
  only where a plain cast reproduces the engine's loader), and whether it can apply deltas.
* :class:`KeyframeClock`: the next sync's kind. *Keyframes* (complete or partial syncs that
  refresh the writer's reference copy) come first, after a failure, every ``full_every_k``-th
  sync (complete; :data:`DELTA_EVERY_K` while deltas run and it is None), once the deltas since
  the last keyframe add up past ``delta_budget`` times its bytes, and after the engine's dtypes
  changed (:meth:`KeyframeClock.rebase`); deltas in between. With ``delta="auto"`` whether
  deltas run at all is measured (:class:`~.choice.DeltaChoice`: where the bytes go, and
  what each kind cost in the run).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .choice import DeltaChoice

DELTA_MODES = ("auto", "on", "off")
DELTA_EVERY_K = 64  # a keyframe every 64 syncs while deltas run, unless full_every_k says
# A keyframe once the deltas since the last add up past this many times its bytes: the served
# chain (the keyframe and every delta since) then holds at most about twice a complete file.
DELTA_BUDGET = 1.0
# What an engine may report holding a tensor in that a plain cast reproduces (an fp8 weight
# comes with scales: not a cast, so such a tensor keeps the trainer's dtype).
_CASTABLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def delta_mode(
    delta: str | bool, full_every_k: int | None, delta_budget: float = DELTA_BUDGET
) -> str:
    """The delta options checked (a ``ValueError`` names the wrong one) and ``delta``
    normalised: YAML's on/off/true/false arrive as booleans, and mean ``"on"`` / ``"off"``."""
    if full_every_k is not None and full_every_k < 1:
        raise ValueError(f"full_every_k must be >= 1 or None, not {full_every_k}")
    if isinstance(delta, bool):
        delta = "on" if delta else "off"
    if delta not in DELTA_MODES:
        raise ValueError(f"delta must be one of {DELTA_MODES} (or a bool), not {delta!r}")
    if not delta_budget > 0:
        raise ValueError(f"delta_budget must be > 0, not {delta_budget}")
    return delta


def castable_dtype(name: str | None) -> torch.dtype | None:
    """A dtype the engine reported (``"bfloat16"``, ``"torch.bfloat16"``), if a plain cast
    (``Tensor.to``: to nearest, ties to even, as the engine's loader) reproduces it."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    return dtype if dtype in _CASTABLE else None


class EngineDtypes:
    """What the engine said it holds each tensor in (checkpoint name -> dtype name): the
    ``report.dtypes`` of its last complete push, with what partial pushes reported since.
    ``accepts``: the last complete push reported them, so the engine can apply deltas (an
    engine that does not report cannot)."""

    def __init__(self) -> None:
        self.known: dict[str, str] = {}
        self.accepts = False

    def forget(self) -> None:
        """A new run, or a failed sync: nothing is known (the next sync is written in the
        trainer's dtype, and takes no delta)."""
        self.known = {}
        self.accepts = False

    def pushed(self, kind: str, reported: Mapping[str, str]) -> bool:
        """After a successful push of ``kind``: a complete one's report replaces what is known
        (empty: the engine does not report, so it takes no delta), a partial one's adds to it, a
        delta's changes nothing. Whether the dtypes changed (a checkpoint written in the
        engine's dtypes then needs a keyframe: :meth:`KeyframeClock.rebase`)."""
        if kind == "delta":
            return False
        known = dict(reported) if kind == "complete" else {**self.known, **reported}
        if kind == "complete":
            self.accepts = bool(known)
        changed = known != self.known
        self.known = known
        return changed

    def dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype tensor ``name``, held by the trainer in ``dtype``, is written in: a
        floating one in the engine's where a plain cast reproduces it, else as it is."""
        if not dtype.is_floating_point:
            return dtype
        return castable_dtype(self.known.get(name)) or dtype


class KeyframeClock:
    """Which kind the next sync is: ``"complete"``, ``"partial"`` (what can change, whole) or
    ``"delta"``, from how the syncs so far ended (:meth:`pushed`, :meth:`failed`).

    ``partials_in_row`` counts the syncs since the last complete one (partial ones and deltas),
    None while the next sync must be complete. ``has_base``: the last push left a reference copy
    a delta can be diffed against (a keyframe written while deltas were on, or a delta);
    ``delta_bytes``: the bytes of the deltas since the last keyframe, of ``keyframe_bytes``.
    ``skip_frozen``: a sync that is neither complete nor a delta may leave out what training
    cannot change (else it is complete).
    """

    def __init__(
        self,
        delta: str | bool = "auto",
        full_every_k: int | None = None,
        delta_budget: float = DELTA_BUDGET,
        skip_frozen: bool = False,
    ) -> None:
        self.delta = delta_mode(delta, full_every_k, delta_budget)
        self.full_every_k = full_every_k
        self.delta_budget = delta_budget
        self.skip_frozen = skip_frozen
        self.partials_in_row: int | None = None
        self.has_base = False
        self.delta_bytes = 0
        self.keyframe_bytes = 0
        self.choice = DeltaChoice()  # delta="auto": measured
        self._accepts = False  # what the engine said when the sync being sent was chosen

    def delta_on(self, engine_accepts: bool) -> bool:
        """Whether deltas run: ``delta="on"``, or ``"auto"`` with an engine that accepts them
        where they are measured cheaper (:class:`~.choice.DeltaChoice`)."""
        if self.delta == "auto":
            return engine_accepts and self.choice.wants_deltas()
        return self.delta == "on"

    def kind(self, engine_accepts: bool = False) -> str:
        """The next sync: ``"complete"``, ``"partial"`` or ``"delta"``.

        ``engine_accepts``: the engine's last complete push said it can apply deltas."""
        self._accepts = engine_accepts
        deltas = self.delta_on(engine_accepts)
        every = self.full_every_k
        if every is None and deltas:
            every = DELTA_EVERY_K
        if self.partials_in_row is None or (
            every is not None and self.partials_in_row + 1 >= every
        ):
            return "complete"
        if deltas and self.has_base and not self.over_budget():
            return "delta"
        return "partial" if self.skip_frozen else "complete"

    def over_budget(self) -> bool:
        """The deltas since the last keyframe add up past ``delta_budget`` of its bytes."""
        return self.delta_bytes > self.delta_budget * self.keyframe_bytes

    def partial_due(self) -> bool:
        """Whether the next sync may leave out what cannot change (deltas off)."""
        return self.kind() == "partial"

    def described(self, kind: str) -> dict:
        """Why the sync just chosen (:meth:`kind`) is ``kind``, with the measured costs
        (:meth:`DeltaChoice.describe`): for its record."""
        return self.choice.describe(self.delta, self._accepts, kind == "delta")

    def pushed(
        self,
        partial: bool,
        delta: bool = False,
        nbytes: int = 0,
        based: bool = False,
        seconds: float | None = None,
    ) -> None:
        """A sync succeeded: ``partial`` (what cannot change left out), ``delta``, its
        ``nbytes``; ``based``: a keyframe that refreshed the reference copy; ``seconds``: what
        it cost (save + push), measured for ``delta="auto"`` once the engine accepted deltas
        (a run's first sync, in the trainer's dtype, is not)."""
        if seconds is not None and self.delta == "auto" and self._accepts:
            self.choice.measured("delta" if delta else "full", based, seconds)
        complete = not partial and not delta
        self.partials_in_row = 0 if complete else (self.partials_in_row or 0) + 1
        if delta:
            self.delta_bytes += nbytes
            return
        self.keyframe_bytes, self.delta_bytes, self.has_base = nbytes, 0, based

    def failed(self) -> None:
        """After a failed sync the engine may serve another base, and the writer's reference
        copy is not trusted: the next sync is complete."""
        self.partials_in_row = None
        self.rebase()

    def rebase(self) -> None:
        """No delta until the next keyframe (the reference copy is gone or stale, or the
        engine's dtypes changed)."""
        self.has_base = False
        self.delta_bytes = 0
