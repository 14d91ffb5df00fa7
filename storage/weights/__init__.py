"""Weight versions on the object store: full HF safetensors copies and lossless deltas, with manifests."""

from sluiceway.storage.weights.errors import BaseMismatch, CorruptWeights, MissingVersion, WeightSyncError
from sluiceway.storage.weights.manifest import Manifest
from sluiceway.storage.weights.materialize import local_version, materialize, verify
from sluiceway.storage.weights.publish import WeightPublisher
from sluiceway.storage.weights.store import WeightStore

__all__ = [
    "BaseMismatch", "CorruptWeights", "Manifest", "MissingVersion", "WeightPublisher", "WeightStore",
    "WeightSyncError", "local_version", "materialize", "verify",
]  # fmt: skip
