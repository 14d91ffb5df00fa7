"""Embedded rollout engines as Ray actors (`--ray-address`): each actor starts `sluiceway engine` on its node.

The engine listens on its node's address (the run's router, on the flow's machine, must reach it) on a port the OS
picked; the run attaches the URLs like `--rollout-external-engine-addrs`, so routing, health checks and weight
updates are the engine group's as for any engine (infra/engine_group.py). Weight versions are loaded from a path,
which on a multi-node cluster must be a shared volume, or pulled as deltas by a pool agent (docs/deploy.md). An
engine dies with its actor (parent-death signal), and the actors with the flow's process (Ray removes a dead
owner's actors).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from sluiceway.infra.proc import child_env, die_with_parent


class EngineActor:
    """One engine process on one node (a Ray actor; `ray.remote` is applied by `start_engines`)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self, command: Callable[[str, int], list[str]], log_path: str) -> str:
        """Start `command(host, port)` on this node (Ray set CUDA_VISIBLE_DEVICES to the actor's GPUs)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:  # a free port on this node (the engine binds it itself)
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        cmd = command(host, port)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=child_env(), preexec_fn=die_with_parent)  # fmt: skip
        return f"http://{host}:{port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def embedded_command(model_dir: str, engine_args: list[str], host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "sluiceway.flows.cli", "engine", "--model", model_dir, "--host", host,
            "--port", str(port), *engine_args]  # fmt: skip


class RayEngines:
    """`count` engine actors, each holding `resources` ({"CPU": n} for an embedded engine, {"GPU": tp, "CPU": 1}
    for SGLang), spread over the cluster's nodes where room allows; `command(host, port)` starts one."""

    def __init__(
        self,
        count: int,
        resources: dict[str, float],
        command: Callable[[str, int], list[str]],
        log_dir: Path,
        timeout_s: float = 300,
    ):
        import ray
        from ray.exceptions import GetTimeoutError

        cls = ray.remote(EngineActor)
        opts = {"num_cpus": resources.get("CPU", 1), "num_gpus": resources.get("GPU", 0), "max_restarts": 0}
        self.actors = [cls.options(scheduling_strategy="SPREAD", **opts).remote() for _ in range(count)]
        try:
            refs = [a.start.remote(command, str(log_dir / f"ray-engine-{i}.log")) for i, a in enumerate(self.actors)]
            self.urls = ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            self.close()
            raise RuntimeError(
                f"the Ray cluster found no room for {count} engine(s) of {resources} within {timeout_s:.0f} s "
                f"(free: {ray.available_resources()}); change --rollout-num-engines / --engine-num-threads, or "
                f"--rollout-num-gpus / --rollout-num-gpus-per-engine"
            ) from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=20)
            except Exception:  # noqa: BLE001 - its node may be gone already
                pass
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
