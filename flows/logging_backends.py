"""Where per-step scalars go besides the metrics table: TensorBoard event files always, wandb when asked.

TensorBoard files are written with tensorboardX (light: numpy and protobuf) under ``OUTPUT_DIR/tensorboard``
(or ``--tensorboard-dir``); point ``tensorboard --logdir`` at it. wandb is imported only with ``--use-wandb``
and is not a dependency; its API key comes from the environment (``WANDB_API_KEY``) or ``wandb login``,
never from the config. The config sent to wandb is the run config, which holds no secrets.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.infra.errors import UserError


def tensorboard_dir(cfg: RunConfig) -> Path:
    return Path(cfg.logging.tensorboard_dir or Path(cfg.storage.output_dir) / "tensorboard").resolve()


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[k] = f
    return out


class TensorBoardBackend:
    def __init__(self, logdir: Path):
        from tensorboardX import SummaryWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self._writer = SummaryWriter(str(logdir), flush_secs=10)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbBackend:
    def __init__(self, cfg: RunConfig):
        try:
            import wandb
        except ImportError:
            raise UserError("--use-wandb: the wandb package is not installed (pip install wandb)") from None
        lg = cfg.logging
        if lg.wandb_host:
            os.environ.setdefault("WANDB_BASE_URL", lg.wandb_host)
        run_dir = Path(cfg.storage.output_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(
            project=lg.wandb_project or "sluiceway",
            entity=lg.wandb_team,
            group=lg.wandb_group,
            name=cfg.run_id,
            id=lg.wandb_run_id,
            resume="allow" if lg.wandb_run_id else None,
            mode=lg.wandb_mode,
            dir=str(run_dir),
            config=cfg.model_dump(mode="json"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricLoggers:
    """Fan-out of per-step scalars. Eval metrics are logged at the number of steps trained, like the table."""

    def __init__(self, backends: list):
        self.backends = backends

    @classmethod
    def open(cls, cfg: RunConfig) -> MetricLoggers:
        backends: list = [TensorBoardBackend(tensorboard_dir(cfg))]
        if cfg.logging.use_wandb:
            backends.append(WandbBackend(cfg))
        return cls(backends)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = _finite(metrics)
        for b in self.backends:
            b.log(step, clean)

    def close(self) -> None:
        for b in self.backends:
            b.close()


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] from every event file under `logdir` (the TFRecord framing, no TensorFlow)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            record = data[i + 12 : i + 12 + n]
            i += 12 + n + 4  # length, its crc, the record, its crc
            event = event_pb2.Event()
            event.ParseFromString(record)
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out
