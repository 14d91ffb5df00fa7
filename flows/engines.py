"""The rollout engines of a run: embedded engines and/or external ones, behind one sglang-router.

Generation goes through the router; control calls (abort, pause, weight updates) go to each engine, because
the router does not forward them. The async client lives on a private loop so synchronous Prefect tasks
can use it.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.flows.preflight import engine_max_total_len
from sluiceway.infra.aio import BackgroundLoop
from sluiceway.infra.pool import EnginePool
from sluiceway.infra.proc import child_env
from sluiceway.infra.router import HOST, SGLangRouter
from sluiceway.infra.sglang_launcher import require_sglang, sglang_server_command
from sluiceway.models.lora import is_adapter_dir, lora_server_args
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights import WeightStore
from sluiceway.tasks.rollout.client import EngineClient
from sluiceway.tasks.rollout.dispatch import PoolTarget

log = logging.getLogger("sluiceway")


def embedded_engine_threads(cfg: RunConfig) -> int:
    """Each embedded engine's torch threads: rollout.engine_num_threads, else the cores split over the engines."""
    r = cfg.rollout
    if r.engine_num_threads is not None:
        return r.engine_num_threads
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
    cores = cfg.resources.num_threads or usable or 1
    return max(1, cores // max(1, r.rollout_num_engines))


class RolloutEngines:
    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path, weight_version: int = 0, wait: bool = True):
        """Start the router and the embedded engines. With `wait` False the engines load their model while the
        caller goes on (building the trainer, say); `wait_ready` then waits for them before the first request."""
        r = cfg.rollout
        log_dir = run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        max_total = engine_max_total_len(cfg)  # eval's responses may be longer than training's
        engine_args = (
            "--max-running-requests", str(r.engine_max_running_requests), "--max-total-len", str(max_total),
            "--dtype", "bfloat16" if cfg.training.bf16 else "float32", "--weight-version", str(weight_version),
            "--num-threads", str(embedded_engine_threads(cfg)),
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
                    extra_args=[*lora_server_args(cfg), *(r.sglang_server_args or [])],
                )
                return cmd, {"CUDA_VISIBLE_DEVICES": gpus}

        self.ray_engines = None
        local_engines, external = r.rollout_num_engines, list(r.rollout_external_engine_addrs or ())
        if cfg.resources.ray_address is not None:
            # Engines as Ray actors on the cluster's nodes, attached by their node addresses (infra/ray_engines.py).
            from sluiceway.infra.ray_engines import RayEngines, embedded_command
            from sluiceway.tasks.train.ray_group import connect

            connect(cfg.resources.ray_address)
            if r.rollout_engine == "sglang":
                tp = r.rollout_num_gpus_per_engine
                count = (r.rollout_num_gpus or tp * r.rollout_num_engines) // tp
                command = functools.partial(_sglang_on_node, str(model_dir), tp, cfg)
                resources = {"GPU": tp, "CPU": 1}
            else:  # each asks the cluster for engine_num_threads CPUs (default 1), not this machine's cores
                cpus = r.engine_num_threads or 1
                args = [*engine_args[: engine_args.index("--num-threads")], "--num-threads", str(cpus)]
                count, resources = r.rollout_num_engines, {"CPU": cpus}
                command = functools.partial(embedded_command, str(model_dir), args)
            self.ray_engines = RayEngines(count, resources, command, log_dir)
            local_engines, external = 0, external + self.ray_engines.urls
        self.router = SGLangRouter(log_dir).start()
        try:
            self.pool = EnginePool(
                str(model_dir),
                local_engines,
                log_dir,
                router=self.router,
                external_urls=external,
                engine_args=engine_args,
                env=child_env(),  # no credentials: engines never touch the store (infra/proc.py)
                launcher=launcher,
            ).spawn()
        except BaseException:
            self.router.close()
            if self.ray_engines is not None:
                self.ray_engines.close()
            raise
        self.cfg, self.loop, self.client, self.remote = cfg, None, None, []
        self.weight_version = weight_version  # what the engines serve; set after each update
        # SGLang engines take LoRA adapter versions through their LoRA endpoints (the embedded engine merges them
        # on /update_weights_from_disk; it also has the endpoints: tests/integration/test_lora_endpoints.py).
        self.lora_endpoints = r.rollout_engine == "sglang"
        if wait:
            self.wait_ready()

    def wait_ready(self) -> RolloutEngines:
        """Wait until every engine is healthy and behind the router; then the client can generate."""
        if self.client is not None:
            return self
        try:
            self.pool.wait_ready()  # stops the engines if one fails to start
        except BaseException:
            self.router.close()
            if self.ray_engines is not None:
                self.ray_engines.close()
            raise
        self.loop = BackgroundLoop()
        self.client = self.loop.run(self._make_client(self.router.url, self.pool.urls))
        self.remote = self._remote_pools(self.cfg)
        return self

    async def _make_client(self, router_url: str, engine_urls: list[str]) -> EngineClient:
        return EngineClient(router_url, engine_urls)  # created on the loop that will use it

    def _remote_pools(self, cfg: RunConfig) -> list[PoolTarget]:
        """Remote pools: generation through their routers; what they serve, from their agents' reports."""
        if not cfg.remote_pools:
            return []
        wstore = WeightStore(ObjectStore.from_uri(cfg.weights_uri, cfg.storage.s3_endpoint_url, cfg.storage.s3_region))
        targets = []
        for name, url in cfg.remote_pools:
            # No engine URLs: control calls (abort, weight updates) are the pool's own business.
            client = self.loop.run(self._make_client(url, []))
            targets.append(PoolTarget(name, client, cfg.rollout.rollout_max_concurrency,
                                      read_version=functools.partial(reported_version, wstore, name)))  # fmt: skip
        log.info("remote pools: %s (weight store %s)", ", ".join(f"{n}={u}" for n, u in cfg.remote_pools), wstore)
        return targets

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
        if self.lora_endpoints and is_adapter_dir(model_dir):
            # SGLang serves adapters beside its base weights: load each version as one, requests name it.
            self.run(self.client.load_lora_adapter(str(model_dir), version))
        else:  # full weights; an embedded engine merges an adapter directory into its base weights itself
            self.run(self.client.update_weights_from_disk(str(model_dir), version))
        self.weight_version = version

    def close(self) -> None:
        """Stop the engines and the router; a second call does nothing."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            if self.loop is not None:  # None: closed before wait_ready
                for t in self.remote:
                    self.run(t.client.aclose())
                self.run(self.client.aclose())
        finally:
            if self.loop is not None:
                self.loop.close()
            self.pool.close()
            self.router.close()
            if self.ray_engines is not None:
                self.ray_engines.close()


def _sglang_on_node(model_dir: str, tp: int, cfg: RunConfig, host: str, port: int) -> list[str]:
    """An SGLang server on a Ray node: the actor's GPUs are its CUDA_VISIBLE_DEVICES."""
    extra = [*lora_server_args(cfg), *(cfg.rollout.sglang_server_args or [])]
    return sglang_server_command(model_dir, host, port, tp_size=tp, dtype="bfloat16" if cfg.training.bf16 else "auto",
                                 seed=cfg.training.seed, extra_args=extra)  # fmt: skip


def reported_version(wstore: WeightStore, name: str) -> int | None:
    """The oldest version pool ``name``'s engines serve, as its agent last reported (None: no report yet)."""
    status = wstore.pool_status(name)
    if status is None:
        return None
    v = status.get("serving", status.get("version"))
    return int(v) if v is not None else None


class TeacherEngine:
    """On-policy distillation's teacher (opd_type sglang): a client to opd_teacher_url, or an embedded engine the
    run starts on opd_teacher_load (loopback, no router: it only scores) and stops with the run.

    Its engine starts loading at construction; `wait_ready(loop)` waits for it and makes the client on `loop`,
    the student engines' loop, so the scoring stage runs there as rollout does."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        a = cfg.algorithm
        self.pool, self.loop, self.client = None, None, None
        self.url = a.opd_teacher_url
        if self.url is None:
            from sluiceway.models.zoo import resolve_checkpoint

            # Scoring takes no KV cache slot: one is the least an engine holds.
            engine_args = (
                "--max-running-requests", "1", "--max-total-len", str(engine_max_total_len(cfg)),
                "--dtype", "bfloat16" if cfg.training.bf16 else "float32",
                "--num-threads", str(embedded_engine_threads(cfg)),
            )  # fmt: skip
            model = str(resolve_checkpoint(a.opd_teacher_load))
            self.pool = EnginePool(model, 1, run_dir / "logs" / "teacher", engine_args=engine_args, env=child_env())
            self.pool.spawn()

    def wait_ready(self, loop: BackgroundLoop) -> TeacherEngine:
        if self.client is not None:
            return self
        self.loop = loop
        if self.pool is not None:
            self.pool.wait_ready()
            self.url = self.pool.urls[0]
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
            if self.pool is not None:
                self.pool.close()
