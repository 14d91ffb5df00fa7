"""A pool as the rollout sees it: somewhere a group can be generated, with its room and the version it serves.

Its own module because both sides of the rollout's pool model use it: the directory that finds the pools
(pool_directory.py) makes targets, and the dispatcher (dispatch.py) leases their room; neither imports the other
for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sluiceway.tasks.rollout.client import GenerateResult

LOCAL = "local"  # the run's own engines: the name in the trajectories table's `pool` column


class RolloutClient(Protocol):
    """What the rollout needs of an engine client (tasks/rollout/client.py's EngineClient; a scripted fake in tests).

    ``generate`` raises EngineCallError when the pool cannot answer (its router unreachable, every engine gone).
    """

    router_url: str  # names the engines that made a remote pool's rows

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        rid: str,
        return_logprob: bool = True,
        routing_key: str | None = None,
        min_weight_version: int | None = None,
        max_weight_version: int | None = None,
    ) -> GenerateResult: ...

    async def abort_all(self) -> None:
        """Every request in flight returns now with the tokens it has (finish_reason "abort")."""
        ...


@dataclass
class PoolTarget:
    name: str
    client: RolloutClient  # generate() through the pool's router
    capacity: int  # samples in flight at once
    local: bool = False  # the run's own engines: abortable, always current
    version: int | None = None  # what the pool serves now (None: unknown); a remote pool's, from its record
    in_flight: int = 0
    benched_until: float = 0.0
    draining: bool = False  # leaving: keeps its groups, takes no new ones (a registry pool)
    silent: bool = False  # its heartbeat stopped (a registry pool)
    gone: bool = False  # left the registry, or dropped from it


def own_engines(client: RolloutClient, capacity: int) -> PoolTarget:
    """The run's own engines as a target: always current (the flow updates them before the step's rollout) and
    abortable through ``client``; ``capacity`` is the run's --rollout-max-concurrency."""
    return PoolTarget(LOCAL, client, capacity, local=True)
