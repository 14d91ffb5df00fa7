"""A pool agent's copy of the weights (WORK_DIR/POOL/agent/current): materialized with checksums, checked once when
the agent starts, and fetched again from the store when it is damaged, never handed to an engine."""

from __future__ import annotations

import json
import logging

from weight_helpers import publish_run

from sluiceway.infra.pool_agent import PoolAgent
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.checksums import CHECKSUMS, checksums_problem
from sluiceway.storage.weights.store import WeightStore


class Recording(PoolAgent):
    """An agent whose one engine records the bytes of the model file it is told to load."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loaded: list[bytes] = []

    def _push(self, url, held):
        if held is not None:
            self.loaded.append((self.current / "model.safetensors").read_bytes())
        return held


def test_a_damaged_copy_is_fetched_again_when_the_agent_starts(tmp_path, caplog):
    wstore = WeightStore(ObjectStore.from_uri(str(tmp_path / "store")))
    publish_run(wstore, tmp_path, 3, full_every=2)  # v1 full, v2 delta, v3 full
    work = tmp_path / "pool" / "agent"
    first = Recording("east", wstore, ["http://engine"], work)
    assert first.poll_once() == 3
    good = (first.current / "model.safetensors").read_bytes()
    assert json.loads((first.current / CHECKSUMS).read_text())["weight_version"] == 3
    assert checksums_problem(first.current) is None and first.loaded == [good]

    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF  # the disk under a stopped agent
    (first.current / "model.safetensors").write_bytes(bytes(data))
    restarted = Recording("east", wstore, ["http://engine"], work)
    with caplog.at_level(logging.WARNING, logger="sluiceway.pools"):
        assert restarted.poll_once() == 3
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{restarted.current}/model.safetensors does not match the sha256" in warning, warning
    assert restarted.loaded == [good]  # the engine got the store's bytes, never the damaged copy
    assert (restarted.current / "model.safetensors").read_bytes() == good and restarted.error is None

    caplog.clear()
    restarted.poll_once()  # checked once per start: later polls trust the copy the agent wrote itself
    assert not caplog.records
