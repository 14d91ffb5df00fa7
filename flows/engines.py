"""The rollout engines of a run: embedded engines and/or external ones, behind one sglang-router, and the remote
pools beside them (fixed ones, and the pool registry's: tasks/rollout/pool_directory.py).

Generation goes through the router; control calls (abort, pause, weight updates) go to each engine, because
the router does not forward them. The async client lives on a private loop so synchronous Prefect tasks
can use it. A run with no engines of its own (rollout_num_engines 0 with rollout_pools) starts no router and
no engine: ``client`` is None, and the remote pools do all the generating.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.flows.preflight import engine_max_total_len
from sluiceway.infra.aio import BackgroundLoop
from sluiceway.infra.engine_fleet import EngineFleet, start_scoring_engine
from sluiceway.models.lora import is_adapter_dir, lora_server_args
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights import WeightStore
from sluiceway.storage.weights.pool_registry import PoolRegistry
from sluiceway.tasks.rollout.client import EngineClient
from sluiceway.tasks.rollout.dispatch import PoolTarget
from sluiceway.tasks.rollout.pool_directory import PoolDirectory

log = logging.getLogger("sluiceway")


class RolloutEngines:
    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path, weight_version: int = 0, wait: bool = True):
        """Start the router and the embedded engines. With `wait` False the engines load their model while the
        caller goes on (building the trainer, say); `wait_ready` then waits for them before the first request."""
        r = cfg.rollout
        log_dir = run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resources.ray_address is not None:  # the fleet places engines as Ray actors on the cluster's nodes
            from sluiceway.tasks.train.ray_group import connect

            connect(cfg.resources.ray_address)
        # eval's responses may be longer than training's: engine_max_total_len
        self.fleet = None
        if cfg.has_own_engines:
            self.fleet = EngineFleet(
                cfg, model_dir, log_dir, weight_version, engine_max_total_len(cfg), lora_server_args(cfg)
            )
        self.pool = self.fleet.pool if self.fleet is not None else None
        self.cfg, self.loop, self.client, self.remote, self.directory = cfg, None, None, [], None
        self.weight_version = weight_version  # what the engines serve; set after each update
        # SGLang engines take LoRA adapter versions through their LoRA endpoints (the embedded engine merges them
        # on /update_weights_from_disk; it also has the endpoints: tests/integration/test_lora_endpoints.py).
        self.lora_endpoints = r.rollout_engine == "sglang"
        if wait:
            self.wait_ready()

    def wait_ready(self) -> RolloutEngines:
        """Wait until every engine is healthy and behind the router; then the client can generate."""
        if self.loop is not None:
            return self
        if self.fleet is not None:
            self.fleet.wait_ready()
        self.loop = BackgroundLoop()
        if self.fleet is not None:
            self.client = self.loop.run(self._make_client(self.fleet.router.url, self.pool.urls))
        self.remote = self._remote_pools(self.cfg)
        self.directory = self._pool_directory(self.cfg)
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
        log.info("remote pools: %s (weight store %s)", ", ".join(n for n, _ in cfg.remote_pools), wstore)
        return targets

    def _pool_directory(self, cfg: RunConfig) -> PoolDirectory | None:
        """The pools registered beside the weight store(s) of --rollout-pools auto / a registry URI."""
        if not cfg.pool_registry_uris:
            return None
        s = cfg.storage
        registries = [PoolRegistry(WeightStore(ObjectStore.from_uri(u, s.s3_endpoint_url, s.s3_region)))
                      for u in cfg.pool_registry_uris]  # fmt: skip
        log.info("pools: those registered in %s", ", ".join(map(repr, registries)))
        # Made on the loop that generates (the dispatcher reads the registry there).
        return PoolDirectory(registries, lambda url: EngineClient(url, []), cfg.rollout.rollout_max_concurrency)

    @property
    def has_pools(self) -> bool:
        return bool(self.remote) or self.directory is not None

    def run(self, coro):
        return self.loop.run(coro)

    def prune_dead(self) -> list[str]:
        """Drop engines that died from the pool, the router and the client; the run goes on with the rest."""
        if self.pool is None:  # no engines of its own
            return []
        dead = self.pool.check()
        for url in dead:
            self.client.remove_engine(url)
            log.warning("engine %s is dead and left the pool (%d left)", url, len(self.pool.urls))
        if not self.pool.urls:
            raise RuntimeError(f"every rollout engine is dead; see the logs in {self.pool.log_dir}")
        return dead

    def update_weights(self, model_dir: Path, version: int) -> None:
        if self.client is None:  # no engines of its own: pools pull the version from the weight store
            self.weight_version = version
            return
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
                if self.directory is not None:
                    self.run(self.directory.aclose())
                if self.client is not None:
                    self.run(self.client.aclose())
        finally:
            if self.loop is not None:
                self.loop.close()
            if self.fleet is not None:
                self.fleet.close()


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
        opd = cfg.algorithm.opd
        self.pool, self.loop, self.client = None, None, None
        self.url = opd.teacher_url
        if self.url is None:
            from sluiceway.models.zoo import resolve_checkpoint

            model = str(resolve_checkpoint(opd.teacher_load))
            self.pool = start_scoring_engine(cfg, model, run_dir / "logs" / "teacher", engine_max_total_len(cfg))

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
