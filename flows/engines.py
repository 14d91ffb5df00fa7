"""The rollout engines of a run: embedded engines and/or external ones, behind one sglang-router (an engine group:
infra/engine_group.py), and the remote pools beside them (fixed ones and the pool registry's, in one
directory: tasks/rollout/pool_directory.py); each step's rollout gets them as one dispatcher.

Generation goes through the router; control calls (abort, pause, weight updates) go to each engine, because
the router does not forward them. The async client lives on a private loop so synchronous Prefect tasks
can use it. A run with no engines of its own (rollout_num_engines 0 with rollout_pools) starts no router and
no engine: ``client`` is None, and the remote pools do all the generating.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.flows.preflight import engine_max_total_len
from sluiceway.infra.aio import BackgroundLoop
from sluiceway.infra.engine_fleet import EngineFleet, FleetSettings
from sluiceway.models.lora import is_adapter_dir, lora_server_args
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.pool_registry import PoolRegistry
from sluiceway.storage.weights.store import WeightStore
from sluiceway.tasks.rollout.client import EngineClient
from sluiceway.tasks.rollout.dispatch import PoolDispatcher
from sluiceway.tasks.rollout.pool_directory import FixedPool, PoolDirectory
from sluiceway.tasks.rollout.pool_target import own_engines

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
            self.fleet = EngineFleet(fleet_settings(cfg), model_dir, log_dir, weight_version,
                                     engine_max_total_len(cfg), lora_server_args(cfg))  # fmt: skip
        self.group = self.fleet.group if self.fleet is not None else None
        self.cfg, self.loop, self.client, self.directory = cfg, None, None, None
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
            self.client = self.loop.run(self._make_client(self.fleet.router.url, self.group.urls))
        self.directory = self._pool_directory(self.cfg)
        return self

    async def _make_client(self, router_url: str, engine_urls: list[str]) -> EngineClient:
        return EngineClient(router_url, engine_urls)  # created on the loop that will use it

    def _pool_directory(self, cfg: RunConfig) -> PoolDirectory | None:
        """The remote pools: fixed --rollout-pools NAME=URL ones, whose agents report what they serve in the
        registry beside the run's weight store, and those registered beside the weight store(s) of
        --rollout-pools auto / a registry URI."""
        if not cfg.remote_pools and not cfg.pool_registry_uris:
            return None
        s = cfg.storage

        def registry(uri: str) -> PoolRegistry:
            return PoolRegistry(WeightStore(ObjectStore.from_uri(uri, s.s3_endpoint_url, s.s3_region)))

        fixed = []
        if cfg.remote_pools:
            reports = registry(cfg.weights_uri)
            # No engine URLs for their clients: control calls (abort, weight updates) are the pool's own business.
            fixed = [FixedPool(name, url, reports) for name, url in cfg.remote_pools]
            log.info("remote pools: %s (weight store %s)", ", ".join(n for n, _ in cfg.remote_pools), reports.wstore)
        registries = [registry(u) for u in cfg.pool_registry_uris]
        if registries:
            log.info("pools: those registered in %s", ", ".join(map(repr, registries)))
        # Clients are made on the loop that generates (the dispatcher reads the directory there).
        return PoolDirectory(registries, lambda url: EngineClient(url, []), cfg.rollout.rollout_max_concurrency,
                             fixed=fixed)  # fmt: skip

    def dispatcher(self, capacity: int, min_version: int | None) -> PoolDispatcher:
        """One step's pools: the run's own engines (``capacity`` samples at once) and the remote pools, which take
        groups while they serve ``min_version`` or newer."""
        own = [own_engines(self.client, capacity)] if self.client is not None else []
        return PoolDispatcher(own, min_version, directory=self.directory)

    @property
    def has_pools(self) -> bool:
        return self.directory is not None

    def run(self, coro):
        return self.loop.run(coro)

    def prune_dead(self) -> list[str]:
        """Drop engines that died from the group, the router and the client; the run goes on with the rest."""
        if self.group is None:  # no engines of its own
            return []
        dead = self.group.check()
        for url in dead:
            self.client.remove_engine(url)
            log.warning("engine %s is dead and left the run's engines (%d left)", url, len(self.group.urls))
        if not self.group.urls:
            raise RuntimeError(f"every rollout engine is dead; see the logs in {self.group.log_dir}")
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
                if self.directory is not None:
                    self.run(self.directory.aclose())
                if self.client is not None:
                    self.run(self.client.aclose())
        finally:
            if self.loop is not None:
                self.loop.close()
            if self.fleet is not None:
                self.fleet.close()


def fleet_settings(cfg: RunConfig) -> FleetSettings:
    """The settings the run's engines start with, as infra/engine_fleet.py takes them."""
    r, res = cfg.rollout, cfg.resources
    return FleetSettings(
        rollout_engine=r.rollout_engine,
        num_engines=r.rollout_num_engines,
        external_urls=tuple(r.rollout_external_engine_addrs or ()),
        engine_num_threads=r.engine_num_threads,
        num_threads=res.num_threads,
        max_running_requests=r.engine_max_running_requests,
        sglang_server_args=tuple(r.sglang_server_args or ()),
        gpus_per_engine=r.rollout_num_gpus_per_engine,
        num_gpus=r.rollout_num_gpus,
        ray_address=res.ray_address,
        bf16=bool(cfg.training.bf16),
        seed=cfg.training.seed,
    )
