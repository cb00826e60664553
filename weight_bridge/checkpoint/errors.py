"""The errors of reading and writing checkpoints."""

from __future__ import annotations

import os

from ..errors import WeightBridgeError


class CheckpointError(WeightBridgeError, ValueError):
    """A checkpoint file that cannot be used; names the file, the tensor and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str, tensor: str | None = None):
        self.path = str(path)
        self.tensor = tensor
        self.problem = problem
        where = f"{self.path}: tensor {tensor!r}: " if tensor is not None else f"{self.path}: "
        super().__init__(where + problem)

    @property
    def problems(self) -> dict[str, str]:
        """The tensor it names -> the problem (empty for a problem of the whole file): the
        same shape as :attr:`~weight_bridge.direct.DirectReloadError.problems`."""
        return {self.tensor: self.problem} if self.tensor is not None else {}


class CheckpointWriteError(WeightBridgeError, OSError):
    """Saving a checkpoint failed (disk full, file too large, I/O error).

    The file that was at the path before is untouched and the temporary file is removed.
    ``errno`` is the underlying error's.
    """

    def __init__(self, path: str | os.PathLike, problem: str, code: int | None = None):
        super().__init__(code, f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem
