"""The rollout engines of a run: embedded engines and/or external ones, behind one sglang-router.

Generation goes through the router; control calls (abort, pause, weight updates) go to each engine, because
the router does not forward them. The async client lives on a private loop so synchronous Prefect tasks
can use it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.infra.aio import BackgroundLoop
from sluiceway.infra.pool import EnginePool
from sluiceway.infra.router import HOST, SGLangRouter
from sluiceway.infra.sglang_launcher import require_sglang, sglang_server_command
from sluiceway.tasks.rollout.client import EngineClient

log = logging.getLogger("sluiceway")


class RolloutEngines:
    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path, weight_version: int = 0):
        r = cfg.rollout
        log_dir = run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        max_total = cfg.rollout.rollout_max_prompt_len + cfg.rollout.rollout_max_response_len
        engine_args = (
            "--max-running-requests", str(r.engine_max_running_requests), "--max-total-len", str(max_total),
            "--dtype", "bfloat16" if cfg.training.bf16 else "float32", "--weight-version", str(weight_version),
        )  # fmt: skip
        launcher = None
        if r.rollout_engine == "sglang":
            require_sglang()
            tp = r.rollout_num_gpus_per_engine

            def launcher(index: int, port: int) -> tuple[list[str], dict[str, str]]:
                gpus = ",".join(str(g) for g in range(index * tp, (index + 1) * tp))  # engine i: its own GPUs
                cmd = sglang_server_command(
                    str(model_dir),
                    HOST,
                    port,
                    tp_size=tp,
                    dtype="bfloat16" if cfg.training.bf16 else "auto",
                    seed=cfg.training.seed,
                    extra_args=r.sglang_server_args or [],
                )
                return cmd, {"CUDA_VISIBLE_DEVICES": gpus}

        self.router = SGLangRouter(log_dir).start()
        try:
            self.pool = EnginePool(
                str(model_dir),
                r.rollout_num_engines,
                log_dir,
                router=self.router,
                external_urls=r.rollout_external_engine_addrs or (),
                engine_args=engine_args,
                env=dict(os.environ),
                launcher=launcher,
            ).start()
        except BaseException:
            self.router.close()
            raise
        self.loop = BackgroundLoop()
        self.client = self.loop.run(self._make_client())
        self.weight_version = weight_version  # what the engines serve; set after each update

    async def _make_client(self) -> EngineClient:
        return EngineClient(self.router.url, self.pool.urls)  # created on the loop that will use it

    def run(self, coro):
        return self.loop.run(coro)

    def prune_dead(self) -> list[str]:
        """Drop engines that died from the pool, the router and the client; the run goes on with the rest."""
        dead = self.pool.check()
        for url in dead:
            self.client.remove_engine(url)
            log.warning("engine %s is dead and left the pool (%d left)", url, len(self.pool.urls))
        if not self.pool.urls:
            raise RuntimeError(f"every rollout engine is dead; see the logs in {self.pool.log_dir}")
        return dead

    def update_weights(self, model_dir: Path, version: int) -> None:
        self.prune_dead()  # a dead engine cannot take the update; the router already routes around it
        self.run(self.client.update_weights_from_disk(str(model_dir), version))
        self.weight_version = version

    def close(self) -> None:
        try:
            self.run(self.client.aclose())
        finally:
            self.loop.close()
            self.pool.close()
            self.router.close()
