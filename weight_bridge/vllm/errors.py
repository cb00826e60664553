"""The errors a client of a bridged engine raises besides the direct-reload core's
(:class:`~weight_bridge.direct.DirectReloadError`,
:class:`~weight_bridge.checkpoint.CheckpointError`): the same type in every process and over
HTTP. No vLLM import."""

from __future__ import annotations

from typing import Any

from ..errors import WeightBridgeError


class EngineUndefinedError(WeightBridgeError, RuntimeError):
    """The engine's weights are half-written; it refuses to generate until a push succeeds."""


#: In every message of an undefined engine; a request vLLM ended with the ``error`` finish
#: reason and a ``stop_reason`` holding it was ended because the engine is undefined.
UNDEFINED = "the engine's weights are undefined"


def undefined_message(why: str) -> str:
    """What a request, a resume or a generate is told while a rank's weights are undefined."""
    return f"{UNDEFINED} ({why}): push a complete checkpoint before generating"


class UpdateInProgressError(WeightBridgeError, RuntimeError):
    """``start_weight_update`` while another update is active: vLLM's engine takes one update at
    a time. ``since``: when the active update started (seconds since the epoch); ``version``:
    the version it is writing, once its ``update_weights`` named one; ``expires_in_s``: after
    how many more seconds without a call of its own the active update is abandoned and the next
    ``start_weight_update`` goes ahead (a trainer that died between start and finish). Over
    HTTP this is ``409 Conflict`` with the same message
    (:class:`~weight_bridge.vllm.clients.http.HTTPClient` raises this type for it)."""

    def __init__(
        self,
        message: str,
        since: float | None = None,
        version: str | None = None,
        expires_in_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.since = since
        self.version = version
        self.expires_in_s = expires_in_s

    @classmethod
    def active(
        cls, since: float, version: str | None, expires_in_s: float
    ) -> UpdateInProgressError:
        import datetime

        when = datetime.datetime.fromtimestamp(since, datetime.timezone.utc)
        which = f" of version {version!r}" if version is not None else ""
        message = (
            f"a weight update{which} is active since {when.isoformat(timespec='milliseconds')}: "
            "one update at a time; retry after its finish_weight_update (it is abandoned if it "
            f"makes no call within {max(expires_in_s, 0.0):.1f} s)"
        )
        return cls(message, since, version, expires_in_s)

    def to_dict(self) -> dict[str, Any]:
        return {"since": self.since, "version": self.version, "expires_in_s": self.expires_in_s}


class AdapterVersionError(WeightBridgeError, LookupError):
    """A request named an adapter version the engine does not hold (it left its LoRA slot, or
    was never pushed): refused before anything is sent, naming the versions it does hold."""
