"""Sync one weight version: write the trainer's weights as a model directory, load it on every engine, and with
`--update-weight-mode delta` publish it to the weight store, where remote pools pull it.

Plain functions of the run config and the live objects they act on; the runtime (flows/runtime.py) holds the
one publisher a process keeps, and `flows/rl.py`'s `sync_task` calls `sync_weights` through it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.publish import WeightPublisher
from sluiceway.storage.weights.store import WeightStore

log = logging.getLogger("sluiceway")


def sync_due(cfg: RunConfig, step: int) -> bool:
    """Whether rollout `step` ends with a sync: every update_weights_interval steps, and after the last."""
    return not ((step + 1) % cfg.sync.update_weights_interval and step + 1 != cfg.rollout.num_rollout)


def adapter_sync(cfg: RunConfig) -> bool:
    """Whether each version is a LoRA adapter (--lora-rank with --lora-sync adapter), not full weights."""
    return cfg.training.lora is not None and cfg.sync.lora_sync == "adapter"


def weight_publisher(cfg: RunConfig) -> WeightPublisher:
    """The run's publisher to its weight store (one per process: it holds the last version to diff against)."""
    s = cfg.sync
    store = ObjectStore.from_uri(cfg.weights_uri, cfg.storage.s3_endpoint_url, cfg.storage.s3_region)
    # A --bf16 run publishes bf16 weights (sync_weights writes them so), of which most elements keep every
    # bit from one step to the next at small learning rates (the fp32 masters change almost everywhere).
    # A pool serving fp32 upcasts them exactly. float_dtype also casts an fp32 directory, should one come.
    return WeightPublisher(
        WeightStore(store), full_every=s.weights_full_every, keep=s.weights_keep,
        float_dtype="BF16" if cfg.training.bf16 and not adapter_sync(cfg) else None,  # adapters stay fp32
    )  # fmt: skip


def publish_weights(publisher: WeightPublisher, version: int, path: Path, weights_uri: str) -> None:
    """Publish the model directory `path` as weight `version` (a full copy or a delta)."""
    t0 = time.perf_counter()
    m = publisher.publish(version, path)
    log.info(
        "weights v%d published to %s (%s, %d bytes, %.2f s)",
        m.version, weights_uri, m.kind, m.data_size, time.perf_counter() - t0,
    )  # fmt: skip


def sync_weights(
    cfg: RunConfig, trainer, engines, hf_dir: Path, weights_dir: Path, publisher: Callable[[], WeightPublisher]
) -> Path:
    """Write the trainer's current weights under `weights_dir`, load them on every engine, and with
    update_weight_mode delta publish them (`publisher()` gives the process's publisher); return the directory."""
    # A --bf16 run's engines serve bf16: write the masters rounded as the engines would round them on load.
    dtype = "bfloat16" if cfg.training.bf16 else None
    path = trainer.write_weights(hf_dir, weights_dir, dtype=dtype, adapter_only=adapter_sync(cfg))
    engines.update_weights(path, trainer.weight_version)
    if cfg.sync.update_weight_mode == "delta":
        publish_weights(publisher(), trainer.weight_version, path, cfg.weights_uri)
    return path
