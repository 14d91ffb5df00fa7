"""Why a weight version could not be reproduced; every message names the version and, where one is to blame,
the tensor."""

from __future__ import annotations


class WeightSyncError(Exception):
    def __init__(self, version: int, tensor: str | None, problem: str) -> None:
        self.version, self.tensor, self.problem = version, tensor, problem
        where = f"weights v{version}" + (f" tensor {tensor!r}" if tensor is not None else "")
        super().__init__(f"{where}: {problem}")


class BaseMismatch(WeightSyncError):
    """The delta was made against bytes the receiver does not hold; fall back to a full version."""


class CorruptWeights(WeightSyncError):
    """A stored payload does not decode to what the manifest says (flipped bytes, a truncated file, ...)."""


class MissingVersion(WeightSyncError):
    """The version (or one its chain needs) is not on the store: never written, half written, or pruned."""
