"""torchrun, with a rendezvous whose store listens on 127.0.0.1 only: `python -m sluiceway.tasks.train.torchrun
--rdzv-backend=loopback --nproc-per-node=N ...` (the trainer group, tasks/train/remote.py).

Every torchrun rendezvous starts its c10d TCPStore server on all interfaces, whatever host it is given (static:
--master-addr, c10d: --rdzv-endpoint, is_host, --local-addr); only a listening socket handed to the store keeps
it on loopback. This backend is the static one (one node, the agent hosts the store and the ranks connect to it,
so they listen on nothing for it) with such a store, on a port the OS picks: two runs never collide.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from sluiceway.infra.proc import LOOPBACK, loopback_store


class LoopbackRendezvous(StaticTCPRendezvous):
    def get_backend(self) -> str:
        return "loopback"

    def next_rendezvous(self):
        if self._store is None:
            self._store = loopback_store(self.timeout.total_seconds(), self.world_size)
            self.master_port = self._store.port  # handed to the ranks as MASTER_PORT
        return super().next_rendezvous()


def _create(params: RendezvousParameters) -> LoopbackRendezvous:
    if params.max_nodes != 1:
        raise ValueError("the loopback rendezvous is for one node")
    return LoopbackRendezvous(LOOPBACK, 0, 0, 1, params.run_id, int(params.config.get("timeout", 600)))


rendezvous_handler_registry.register("loopback", _create)

if __name__ == "__main__":
    from torch.distributed.run import main

    main()
