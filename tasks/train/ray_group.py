"""The trainer group as rank actors on an existing Ray cluster (`--ray-address`): same methods as PolicyTrainer.

Placement: one bundle per node (`actor_num_nodes` of them, STRICT_SPREAD when there are several), each with room
for `actor_num_gpus_per_node` ranks (a GPU each, or CPUs on a CPU cluster); rank r runs in bundle
r // actor_num_gpus_per_node. Rank 0 opens the process group's store on its node's address (a socket we bind and
hand to TCPStore, whose own bind is every interface: infra/proc.py), the others join it, and every rank builds
its PolicyTrainer with the same TP/DP code as under torchrun. The flow drives the group by actor calls: each
method runs on every rank (so the collectives inside line up) and rank 0's result is returned.

Actors and the placement group belong to the flow's process: Ray removes them when it exits however it exits,
and `close` removes them at once. A dead node or actor fails the running call with one line naming the rank and
its node; `sluiceway resume` then builds a new group from the checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import traceback
from typing import Any

from sluiceway.infra.errors import UserError
from sluiceway.tasks.train.remote import TrainerGroup, TrainerGroupError


class TrainerRank:
    """One rank (a Ray actor; `ray.remote` is applied where the group is made, so importing this needs no Ray)."""

    def __init__(self, rank: int, world_size: int, threads: int, device: str):
        import torch

        self.rank, self.world_size, self.device = rank, world_size, device
        torch.set_num_threads(threads)
        self.trainer = None
        self._store = None

    def node(self) -> tuple[str, str]:
        """(address, Ray node id) of the node this rank runs on."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def open_store(self) -> tuple[str, int]:
        """Rank 0: the group's TCPStore, listening on this node's address only, on a port the OS picks."""
        import datetime

        import torch.distributed as dist

        host = self.node()[0]
        sock = socket.create_server((host, 0), backlog=64)
        port = sock.getsockname()[1]
        self._store = dist.TCPStore(host, port, self.world_size, True, datetime.timedelta(seconds=300),
                                    wait_for_workers=False, master_listen_fd=sock.detach())  # fmt: skip
        return host, port

    def build(self, init_kwargs: dict, host: str, port: int) -> str:
        """Join the process group and build the trainer; "" on success, else the error with its traceback."""
        import datetime

        import torch.distributed as dist

        try:
            _collectives_on(host)
            store = self._store or dist.TCPStore(host, port, self.world_size, False, datetime.timedelta(seconds=300))
            backend = "nccl" if self.device == "cuda" else "gloo"
            if backend == "nccl":
                import torch

                torch.cuda.set_device(0)  # Ray makes the actor's own GPU device 0 (CUDA_VISIBLE_DEVICES)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size)
            from sluiceway.tasks.train.worker import _build

            self.trainer = _build(init_kwargs)
            return ""
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"

    def call(self, method: str, args: tuple, kwargs: dict) -> tuple[str, Any]:
        from sluiceway.tasks.train.worker import _run

        return _run(self.trainer, ("call", method, args, kwargs))


def _collectives_on(host: str) -> None:
    """Gloo/NCCL sockets on the interface that holds the group's address (loopback when the cluster is local)."""
    if host.startswith("127."):
        ifname = "lo"
    else:
        import psutil

        ifname = next((n for n, addrs in psutil.net_if_addrs().items() if any(a.address == host for a in addrs)), None)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if ifname and name not in os.environ:
            os.environ[name] = ifname


def connect(address: str) -> None:
    """Join the Ray cluster at `address` ('auto' or HOST:PORT) as a driver, once per process.

    ray.init replaces the process's SIGTERM handler (Prefect relies on its own to stop a flow cleanly): kept.
    """
    import ray

    if ray.is_initialized():
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise UserError(
            f"--ray-address {address}: cannot connect to a Ray cluster ({str(e).splitlines()[0]})"
        ) from None
    finally:
        signal.signal(signal.SIGTERM, handler)


class RayTrainer(TrainerGroup):
    def __init__(
        self,
        init_kwargs: dict[str, Any],
        num_nodes: int,
        ranks_per_node: int,
        threads_per_rank: int = 1,
        device: str = "cpu",
        start_timeout_s: float = 600.0,
    ):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = num_nodes * ranks_per_node
        per_rank = {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": threads_per_rank}
        bundles = [{k: v * ranks_per_node for k, v in per_rank.items()} for _ in range(num_nodes)]
        self.pg = placement_group(bundles, strategy="STRICT_SPREAD" if num_nodes > 1 else "PACK")
        self.actors: list = []
        self.nodes: list[tuple[str, str]] = []  # (address, node id) per rank
        try:
            ready, _ = ray.wait([self.pg.ready()], timeout=start_timeout_s)
            if not ready:
                raise TrainerGroupError(
                    f"the Ray cluster has no room for {num_nodes} node(s) x {ranks_per_node} rank(s) of {per_rank} "
                    f"within {start_timeout_s:.0f} s (cluster resources: {ray.cluster_resources()})"
                )
            cls = ray.remote(TrainerRank)
            for r in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r // ranks_per_node)
                opts = {"num_cpus": per_rank["CPU"], "num_gpus": per_rank.get("GPU", 0), "max_restarts": 0}
                actor = cls.options(scheduling_strategy=strategy, **opts)
                self.actors.append(actor.remote(r, self.world_size, threads_per_rank, device))
            self.nodes = self._get([a.node.remote() for a in self.actors])
            host, port = self._get([self.actors[0].open_store.remote()])[0]
            errors = self._get([a.build.remote(init_kwargs, host, port) for a in self.actors])
            failed = [(r, e) for r, e in enumerate(errors) if e]
            if failed:
                r, e = failed[0]
                raise TrainerGroupError(f"trainer rank {r} on {self._where(r)} failed to start: {e}")
        except BaseException:
            self.close()
            raise
        self.weight_version = 0

    def _get(self, refs: list) -> list:
        """Every result, or one line naming the rank and node that died (without waiting for the others)."""
        import ray
        from ray.exceptions import RayActorError

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except RayActorError as e:
                r = refs.index(done[0])
                raise TrainerGroupError(
                    f"trainer rank {r} (Ray actor {e.actor_id}) on {self._where(r)} died: {str(e).splitlines()[0]}; "
                    f"`sluiceway resume` builds a new group from the last checkpoint"
                ) from None
        return ray.get(refs)

    def _where(self, rank: int) -> str:
        if rank >= len(self.nodes):
            return "an unknown node"
        address, node_id = self.nodes[rank]
        return f"node {address} (id {node_id[:12]})"

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        results = self._get([a.call.remote(method, args, kwargs) for a in self.actors])
        for r, (status, value) in enumerate(results):
            if status == "error":
                raise TrainerGroupError(f"trainer rank {r} on {self._where(r)}: {value}")
        return results[0][1]

    def close(self) -> None:
        """Remove the rank actors and the placement group (nothing of the run stays on the cluster)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        self.actors = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - the cluster is gone
                pass
            self.pg = None
