"""A run's engine processes in one place: the router, the engines this machine starts (embedded or SGLang), the
ones Ray places on a cluster's nodes, and the external ones attached by URL; and a scoring engine without a router
(on-policy distillation's teacher).

What this module does not know: how a run talks to the engines (flows/engines.py holds the client and the remote
pools) and what the model is (the caller passes the SGLang arguments LoRA needs, models/lora.lora_server_args,
and the longest sequence, flows/preflight.engine_max_total_len), so infra/ never imports models/ or the stages.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.infra.pool import EnginePool
from sluiceway.infra.proc import child_env
from sluiceway.infra.router import HOST, SGLangRouter
from sluiceway.infra.sglang_launcher import require_sglang, sglang_server_command


def embedded_engine_threads(cfg: RunConfig) -> int:
    """Each embedded engine's torch threads: rollout.engine_num_threads, else the cores split over the engines."""
    r = cfg.rollout
    if r.engine_num_threads is not None:
        return r.engine_num_threads
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
    cores = cfg.resources.num_threads or usable or 1
    return max(1, cores // max(1, r.rollout_num_engines))


def embedded_engine_args(
    cfg: RunConfig, max_total_len: int, max_running: int, threads: int, weight_version: int | None = None
) -> list[str]:
    """The embedded engine's command-line settings (models/engine/server.py `serve`) for this run's precision."""
    dtype = "bfloat16" if cfg.training.bf16 else "float32"
    version = [] if weight_version is None else ["--weight-version", str(weight_version)]
    return ["--max-running-requests", str(max_running), "--max-total-len", str(max_total_len),
            "--dtype", dtype, *version, "--num-threads", str(threads)]  # fmt: skip


def sglang_on_node(model_dir: str, tp: int, cfg: RunConfig, extra_args: list[str], host: str, port: int) -> list[str]:
    """An SGLang server's command (on this machine or a Ray node, whose GPUs are its CUDA_VISIBLE_DEVICES)."""
    return sglang_server_command(model_dir, host, port, tp_size=tp, dtype="bfloat16" if cfg.training.bf16 else "auto",
                                 seed=cfg.training.seed, extra_args=extra_args)  # fmt: skip


class EngineFleet:
    """The router and every engine behind it. Construction starts them (the engines load their model in the
    background); `wait_ready` waits until each is healthy and routed; `close` stops what it started."""

    def __init__(
        self,
        cfg: RunConfig,
        model_dir: Path,
        log_dir: Path,
        weight_version: int,
        max_total_len: int,
        sglang_extra_args: list[str],
    ):
        r = cfg.rollout
        threads = embedded_engine_threads(cfg)
        engine_args = embedded_engine_args(cfg, max_total_len, r.engine_max_running_requests, threads, weight_version)
        sglang_args = [*sglang_extra_args, *(r.sglang_server_args or [])]
        launcher = None
        if r.rollout_engine == "sglang":
            require_sglang()
            tp = r.rollout_num_gpus_per_engine

            def launcher(index: int, port: int) -> tuple[list[str], dict[str, str]]:
                gpus = ",".join(str(g) for g in range(index * tp, (index + 1) * tp))  # engine i: its own GPUs
                return sglang_on_node(str(model_dir), tp, cfg, sglang_args, HOST, port), {"CUDA_VISIBLE_DEVICES": gpus}

        self.ray_engines, self.router = None, None
        local_engines, external = r.rollout_num_engines, list(r.rollout_external_engine_addrs or ())
        if cfg.resources.ray_address is not None:
            # Engines as Ray actors on the cluster's nodes (the caller has joined the cluster), attached by their
            # node addresses (infra/ray_engines.py).
            from sluiceway.infra.ray_engines import RayEngines, embedded_command

            if r.rollout_engine == "sglang":
                tp = r.rollout_num_gpus_per_engine
                count = (r.rollout_num_gpus or tp * r.rollout_num_engines) // tp
                command = functools.partial(sglang_on_node, str(model_dir), tp, cfg, sglang_args)
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
                engine_args=tuple(engine_args),
                env=child_env(),  # no credentials: engines never touch the store (infra/proc.py)
                launcher=launcher,
            ).spawn()
        except BaseException:
            self._stop_router_and_ray()
            raise

    def wait_ready(self) -> None:
        """Wait until every engine is healthy and behind the router (stops everything if one fails to start)."""
        try:
            self.pool.wait_ready()  # stops the engines if one fails to start
        except BaseException:
            self._stop_router_and_ray()
            raise

    def _stop_router_and_ray(self) -> None:
        if self.router is not None:
            self.router.close()
        if self.ray_engines is not None:
            self.ray_engines.close()

    def close(self) -> None:
        try:
            self.pool.close()
        finally:
            self._stop_router_and_ray()


def start_scoring_engine(cfg: RunConfig, model_dir: str, log_dir: Path, max_total_len: int) -> EnginePool:
    """One embedded engine on loopback with no router, for scoring only (it takes no KV cache slot: one is the
    least an engine holds); started, not yet waited for."""
    args = embedded_engine_args(cfg, max_total_len, 1, embedded_engine_threads(cfg))
    return EnginePool(model_dir, 1, log_dir, engine_args=tuple(args), env=child_env()).spawn()
