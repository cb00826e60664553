"""The error a direct reload raises, and why one weight cannot be written in place."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import WeightBridgeError


class DirectReloadError(WeightBridgeError, ValueError):
    """A direct reload was refused (nothing written) or failed (model marked undefined).

    A ``ValueError``: what it names is wrong with the checkpoint (or with where it would be
    written), the caller's input; vLLM's HTTP server answers it with 400 and the message.

    ``problems`` maps each offending tensor name to what is wrong with it. The error crosses
    process boundaries as data (:meth:`to_dict` / :meth:`from_dict`), so a caller gets the same
    type, message and problems from a multi-process engine as from an in-process one.
    """

    def __init__(self, message: str, problems: Mapping[str, str] | None = None):
        self.problems = dict(problems or {})
        self.summary = message
        if self.problems:
            listed = "\n".join(f"  {n}: {why}" for n, why in sorted(self.problems.items()))
            message = f"{message}\n{listed}"
        super().__init__(message)

    @property
    def names(self) -> list[str]:
        return sorted(self.problems)

    def to_dict(self) -> dict:
        return {"message": self.summary, "problems": dict(self.problems)}

    @classmethod
    def from_dict(cls, data: Mapping) -> DirectReloadError:
        return cls(str(data["message"]), dict(data.get("problems") or {}))


class BaseVersionError(DirectReloadError):
    """A partial checkpoint or a delta names a base version the engine does not serve: it
    applies on exactly that version or not at all (nothing was written). Push a complete
    checkpoint (a keyframe)."""


class NotDirectlyReloadable(WeightBridgeError):
    """Why one weight cannot be written in place (raised by :func:`~.resolve.resolve_target`)."""
