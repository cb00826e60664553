"""The one base of every exception the project raises: ``except WeightBridgeError`` catches
them all, and each keeps its own type (and the built-in base a caller of vLLM expects: a
refusal is a ``ValueError``, which vLLM's server answers with 400; a failed write an
``OSError``). Nothing is imported here: every layer can raise from it."""

from __future__ import annotations


class WeightBridgeError(Exception):
    """Raised by weight-bridge, never by what it wraps: the checkpoint, the push, the engine,
    the trainer side. See docs/api.md#errors for each type."""
