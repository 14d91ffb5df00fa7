"""A run's engine processes in one place: the router, the engines this machine starts (embedded or SGLang), the
ones Ray places on a cluster's nodes, and the external ones attached by URL; and a scoring engine without a router
(on-policy distillation's teacher).

What this module does not know: how a run talks to the engines (flows/engines.py holds the client and the remote
pools), what the model is (the caller passes the SGLang arguments LoRA needs, models/lora.lora_server_args,
and the longest sequence, flows/preflight.engine_max_total_len), and the run's config: the caller hands over the
settings the engines start with as a `FleetSettings` (flows/engines.py: `fleet_settings`), so infra/ imports
neither the flows nor models/ nor the stages.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from sluiceway.infra.engine_group import EngineGroup
from sluiceway.infra.proc import child_env
from sluiceway.infra.router import HOST, SGLangRouter
from sluiceway.infra.sglang_launcher import require_sglang, sglang_server_command


@dataclass(frozen=True)
class FleetSettings:
    """What the engines start with: the run config's engine settings as plain values (each field names the config
    field it comes from)."""

    rollout_engine: str  # rollout.rollout_engine: "embedded" or "sglang"
    num_engines: int  # rollout.rollout_num_engines
    external_urls: tuple[str, ...]  # rollout.rollout_external_engine_addrs
    engine_num_threads: int | None  # rollout.engine_num_threads
    num_threads: int | None  # resources.num_threads
    max_running_requests: int  # rollout.engine_max_running_requests
    sglang_server_args: tuple[str, ...]  # rollout.sglang_server_args
    gpus_per_engine: int  # rollout.rollout_num_gpus_per_engine
    num_gpus: int | None  # rollout.rollout_num_gpus
    ray_address: str | None  # resources.ray_address
    bf16: bool  # training.bf16 (resolved from the precision)
    seed: int  # training.seed


def embedded_engine_threads(fs: FleetSettings) -> int:
    """Each embedded engine's torch threads: rollout.engine_num_threads, else the cores split over the engines."""
    if fs.engine_num_threads is not None:
        return fs.engine_num_threads
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
    cores = fs.num_threads or usable or 1
    return max(1, cores // max(1, fs.num_engines))


def embedded_engine_args(
    fs: FleetSettings, max_total_len: int, max_running: int, threads: int, weight_version: int | None = None
) -> list[str]:
    """The embedded engine's command-line settings (models/engine/server.py `serve`) for this run's precision."""
    dtype = "bfloat16" if fs.bf16 else "float32"
    version = [] if weight_version is None else ["--weight-version", str(weight_version)]
    return ["--max-running-requests", str(max_running), "--max-total-len", str(max_total_len),
            "--dtype", dtype, *version, "--num-threads", str(threads)]  # fmt: skip


def sglang_on_node(
    model_dir: str, tp: int, fs: FleetSettings, extra_args: list[str], host: str, port: int
) -> list[str]:
    """An SGLang server's command (on this machine or a Ray node, whose GPUs are its CUDA_VISIBLE_DEVICES)."""
    return sglang_server_command(model_dir, host, port, tp_size=tp, dtype="bfloat16" if fs.bf16 else "auto",
                                 seed=fs.seed, extra_args=extra_args)  # fmt: skip


class EngineFleet:
    """The router and every engine behind it. Construction starts them (the engines load their model in the
    background); `wait_ready` waits until each is healthy and routed; `close` stops what it started."""

    def __init__(
        self,
        fs: FleetSettings,
        model_dir: Path,
        log_dir: Path,
        weight_version: int,
        max_total_len: int,
        sglang_extra_args: list[str],
    ):
        threads = embedded_engine_threads(fs)
        engine_args = embedded_engine_args(fs, max_total_len, fs.max_running_requests, threads, weight_version)
        sglang_args = [*sglang_extra_args, *fs.sglang_server_args]
        launcher = None
        if fs.rollout_engine == "sglang":
            require_sglang()
            tp = fs.gpus_per_engine

            def launcher(index: int, port: int) -> tuple[list[str], dict[str, str]]:
                gpus = ",".join(str(g) for g in range(index * tp, (index + 1) * tp))  # engine i: its own GPUs
                return sglang_on_node(str(model_dir), tp, fs, sglang_args, HOST, port), {"CUDA_VISIBLE_DEVICES": gpus}

        self.ray_engines, self.router = None, None
        local_engines, external = fs.num_engines, list(fs.external_urls)
        if fs.ray_address is not None:
            # Engines as Ray actors on the cluster's nodes (the caller has joined the cluster), attached by their
            # node addresses (infra/ray_engines.py).
            from sluiceway.infra.ray_engines import RayEngines, embedded_command

            if fs.rollout_engine == "sglang":
                tp = fs.gpus_per_engine
                count = (fs.num_gpus or tp * fs.num_engines) // tp
                command = functools.partial(sglang_on_node, str(model_dir), tp, fs, sglang_args)
                resources = {"GPU": tp, "CPU": 1}
            else:  # each asks the cluster for engine_num_threads CPUs (default 1), not this machine's cores
                cpus = fs.engine_num_threads or 1
                args = [*engine_args[: engine_args.index("--num-threads")], "--num-threads", str(cpus)]
                count, resources = fs.num_engines, {"CPU": cpus}
                command = functools.partial(embedded_command, str(model_dir), args)
            self.ray_engines = RayEngines(count, resources, command, log_dir)
            local_engines, external = 0, external + self.ray_engines.urls
        self.router = SGLangRouter(log_dir).start()
        try:
            self.group = EngineGroup(
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
            self.group.wait_ready()  # stops the engines if one fails to start
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
            self.group.close()
        finally:
            self._stop_router_and_ray()


def start_scoring_engine(fs: FleetSettings, model_dir: str, log_dir: Path, max_total_len: int) -> EngineGroup:
    """One embedded engine on loopback with no router, for scoring only (it takes no KV cache slot: one is the
    least an engine holds); started, not yet waited for."""
    args = embedded_engine_args(fs, max_total_len, 1, embedded_engine_threads(fs))
    return EngineGroup(model_dir, 1, log_dir, engine_args=tuple(args), env=child_env()).spawn()
