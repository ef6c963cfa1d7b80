"""The process groups of one tensor-parallel group of ranks.

Each group has its own ``TCPStore`` (hosted by rank 0) and its own process
groups, built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), never
torch.distributed's process-wide default group: two TP groups, or a TP group
and a plain engine, may share a process.

Two process groups per TP group:

* ``control``: gloo on the CPU, always. Rank 0 sends each step's plan over it
  (when the ranks do not share a node: see ``tp_dispatch``) and gathers KV
  blocks for transfers. It waits for the next step without a deadline: an idle
  engine sends nothing for as long as it likes, and a peer that dies closes
  its sockets, which ends the wait at once.
* ``model``: the all-reduces inside the forward pass; NCCL on CUDA, gloo on
  the CPU.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

# How long a rank waits for the others to join, and for a collective in the forward pass.
JOIN_TIMEOUT = datetime.timedelta(seconds=300)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
# The control group's wait for the next step: an idle engine sends nothing for as long as it likes.
IDLE_TIMEOUT = datetime.timedelta(days=3650)
# How often rank 0 looks for the other ranks while they start.
JOIN_POLL_S = 0.05


class RankNeverJoined(RuntimeError):
    """A rank ended, or did not arrive in time, before the group was formed."""


def joined_key(rank: int) -> str:
    return f"joined/{rank}"


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet: rank 0's store (plain data, sent to every rank)."""

    host: str
    port: int
    size: int


def node_address() -> str:
    """An address of this node the other nodes can reach (Ray's node IP when Ray runs here)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return socket.gethostbyname(socket.gethostname())


def host_store(size: int, host: str | None = None) -> tuple[dist.TCPStore, Rendezvous]:
    """Rank 0's store on a free port; returns it and the rendezvous the other ranks join."""
    host = host or node_address()
    store = dist.TCPStore(host, 0, size, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
    return store, Rendezvous(host, store.port, size)


def await_ranks(store: dist.TCPStore, size: int, ended: Callable[[], str | None],
                timeout: datetime.timedelta = JOIN_TIMEOUT) -> None:
    """On rank 0, before its process groups: wait until ranks 1..size-1 have reached the store.

    Building a process group waits for every rank with the group's own timeout, which is
    unbounded for ``control``: a rank that died while it started (an import error, a script
    without an ``if __name__ == "__main__"`` guard under spawn) would leave rank 0 waiting
    forever. ``ended()`` says why a rank is gone (None while all run); either that or the
    timeout raises ``RankNeverJoined``."""
    keys = [joined_key(rank) for rank in range(1, size)]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        reason = ended()
        if reason is not None:
            raise RankNeverJoined(f"{reason} before it joined the tensor-parallel group; its output above says why")
        if time.monotonic() > deadline:
            missing = [key.rpartition("/")[2] for key in keys if not store.check([key])]
            raise RankNeverJoined(f"ranks {', '.join(missing)} of {size} did not join the tensor-parallel group "
                                  f"within {timeout.total_seconds():.0f} s")
        time.sleep(JOIN_POLL_S)


class TensorParallelGroup:
    """Rank ``rank`` of a group of ``rendezvous.size``: its control and model process groups.

    ``all_reduce`` sums a tensor across the ranks in place (the model group);
    ``broadcast_control``/``gather_control`` move CPU tensors over the control group.
    """

    def __init__(self, rendezvous: Rendezvous, rank: int, device: torch.device,
                 store: dist.TCPStore | None = None) -> None:
        if not 0 <= rank < rendezvous.size:
            raise ValueError(f"rank {rank} is outside a group of {rendezvous.size}")
        self.rendezvous = rendezvous
        self.rank = rank
        self.size = rendezvous.size
        self.device = torch.device(device)
        if store is None:
            store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.size, is_master=False,
                                  timeout=JOIN_TIMEOUT)
            store.set(joined_key(rank), b"1")
        self.store = store
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, self.size, IDLE_TIMEOUT)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            self.model = dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, self.size, options)
            self.backend = "nccl"
        else:
            self.model = dist.ProcessGroupGloo(dist.PrefixStore("model", store), rank, self.size,
                                               COLLECTIVE_TIMEOUT)
            self.backend = "gloo"
        self.num_all_reduces = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` across the ranks, in place."""
        self.model.allreduce([tensor]).wait()
        self.num_all_reduces += 1

    def broadcast_model(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` (on the rank's device) into every rank's, over the model group."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.model.broadcast([tensor], options).wait()

    def broadcast_control(self, tensor: torch.Tensor) -> None:
        """Rank 0's CPU ``tensor`` into every rank's ``tensor`` (same shape and dtype)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.control.broadcast([tensor], options).wait()

    def gather_control(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's CPU ``tensor`` (same shape), in rank order, on rank 0; None elsewhere."""
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank == 0:
            outputs = [[torch.empty_like(tensor) for _ in range(self.size)]]
            self.control.gather(outputs, [tensor], options).wait()
            return outputs[0]
        self.control.gather([], [tensor], options).wait()
        return None

    def barrier(self) -> None:
        """Wait until every rank gets here (over the control group)."""
        self.control.barrier().wait()
