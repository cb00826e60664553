"""Deltas: the delta file format and the trainer's delta policy.

:mod:`.format` (what a delta file holds, :func:`~.format.read_delta`, the writer's half
:func:`~.format.encode_sparse`); the trainer's side: :mod:`.reference` (the copy a delta is
diffed against), :mod:`.choice` (``delta="auto"``: deltas where they prove cheaper),
:mod:`.keyframes` (when a sync is a keyframe), :mod:`.sink` (what a sync's file receives: a
keyframe or a delta) and :mod:`.state` (:class:`~.state.DeltaState`: all of it for one run).
The engine's application of a delta (``weight_bridge/direct/delta.py``,
``direct/delta_writes.py``, ``vllm/worker/delta_links.py``) stays with the engine's writers: it
uses the internals of :mod:`weight_bridge.direct`, and moving it here would make ``direct`` and
``delta`` import each other.
Layering: this package imports :mod:`weight_bridge.checkpoint`, :mod:`weight_bridge.exact`,
:mod:`weight_bridge.layout` and itself only; the engine side imports :mod:`.format` only, and
this front imports nothing, so an engine worker that reads a delta loads no trainer policy.
"""
