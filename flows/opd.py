"""On-policy distillation on the flow side, with a teacher engine (opd_type sglang): the engine the run starts or
reaches, the stage that scores each step's samples with it, and what it adds to a step's metrics. The trainer side
is tasks/train/opd.py (the advantage term, and opd_type megatron's teacher in the trainer); the scoring itself is
tasks/rollout/teacher.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.flows.engines import fleet_settings
from sluiceway.flows.preflight import engine_max_total_len
from sluiceway.infra.aio import BackgroundLoop
from sluiceway.infra.engine_fleet import start_scoring_engine
from sluiceway.storage.object_store import ObjectStore
from sluiceway.tasks.rollout.client import EngineClient
from sluiceway.tasks.rollout.teacher import TeacherScores, score_step_with_teacher

log = logging.getLogger("sluiceway")


def has_teacher_engine(cfg: RunConfig) -> bool:
    """The run scores its samples on a teacher engine: a teacher stage after each step's rewards."""
    opd = cfg.algorithm.opd
    return opd is not None and opd.engine


class TeacherEngine:
    """On-policy distillation's teacher (opd_type sglang): a client to opd_teacher_url, or an embedded engine the
    run starts on opd_teacher_load (loopback, no router: it only scores) and stops with the run.

    Its engine starts loading at construction; `wait_ready(loop)` waits for it and makes the client on `loop`,
    the student engines' loop, so the scoring stage runs there as rollout does."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        opd = cfg.algorithm.opd
        self.group, self.loop, self.client = None, None, None
        self.url = opd.teacher_url
        if self.url is None:
            from sluiceway.models.zoo import resolve_checkpoint

            model = str(resolve_checkpoint(opd.teacher_load))
            logs = run_dir / "logs" / "teacher"
            self.group = start_scoring_engine(fleet_settings(cfg), model, logs, engine_max_total_len(cfg))

    def wait_ready(self, loop: BackgroundLoop) -> TeacherEngine:
        if self.client is not None:
            return self
        self.loop = loop
        if self.group is not None:
            self.group.wait_ready()
            self.url = self.group.urls[0]
        self.client = self.loop.run(self._make_client(self.url))
        log.info("on-policy distillation teacher: %s", self.url)
        return self

    async def _make_client(self, url: str) -> EngineClient:
        return EngineClient(url, [url])

    def close(self) -> None:
        try:
            if self.client is not None:
                self.loop.run(self.client.aclose())
        finally:
            if self.group is not None:
                self.group.close()

    def score_step(self, store: ObjectStore, run_id: str, step: int) -> TeacherScores:
        """The step's unscored trainable samples scored and stored, on the student engines' loop."""
        return self.loop.run(score_step_with_teacher(self.client, store, run_id, step))


def teacher_metrics(scores: dict) -> dict[str, float]:
    """A step's teacher stage in its metrics: requests this process sent (0 for a step whose scores were already
    stored, found in the stage ledger), and samples whose scores were already in the table."""
    return {
        "opd/teacher_requests": 0.0 if scores.get("resumed") else float(scores["requests"]),
        "opd/teacher_stored": float(scores["stored"]),
    }
