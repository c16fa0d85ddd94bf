"""Where an attempt's ranks meet: rank 0 hosts a store before any rank joins, and every rank
joins the process group through it, under the one timeout that bounds every collective.

``RankRendezvous`` is the part of ``TrainWorker`` that does it (``address()``, the join).
"""

from __future__ import annotations

import datetime
import gc
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raytrain_ckpt.rank.nccl_trace import enable_recorder

__all__ = ["AUTO_COLLECTIVE_S", "RankRendezvous", "Rendezvous", "collective_timeout_s"]

AUTO_COLLECTIVE_S = 600.0
"""With auto, the timeout of every collective: a backstop far beyond the controller's budget, which
detects the hang first (with stacks) and tears the group down."""


def collective_timeout_s(ft: Any) -> float:
    """The timeout of the rendezvous and every collective for the ``fault_tolerance`` section ``ft``."""
    fixed = ft.hang_timeout_s if not isinstance(ft.hang_timeout_s, str) else AUTO_COLLECTIVE_S
    return max(fixed, ft.join_s)


def _deterministic_cuda() -> None:
    """Only deterministic CUDA kernels from here on (``training.deterministic``). cuBLAS reads
    its workspace setting when this process creates its first handle, i.e. at the first
    matmul, which comes after this call (made in join(); setup() waits for it): the actor has
    not run one before."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


@dataclass(frozen=True)
class Rendezvous:
    """Where an attempt's ranks meet: the store rank 0 hosts (``TrainWorker.address``)."""

    host: str
    port: int


class RankRendezvous:
    """A rank's rendezvous, as a part of ``TrainWorker``: uses its ``spec``, ``rank``,
    ``world_size``, ``timings`` and ``_store`` (rank 0's store, listening from ``address()``)."""

    spec: Any
    rank: int
    world_size: int
    timings: dict[str, float]
    _store: dist.TCPStore | None
    _meet: tuple[str, int]

    @property
    def group_size(self) -> int:
        """Ranks in this rank's process group: one replica group's (the world without replicas)."""
        return self.world_size // self.spec.parallelism.dp_replicate

    @property
    def replica(self) -> int:
        """This rank's replica group (ranks ``replica x group_size ..`` are its ranks 0 ..)."""
        return self.rank // self.group_size

    def address(self) -> Rendezvous:
        """Host the attempt's rendezvous (rank 0): a store already listening on a free port of
        this node, and its address for the other ranks' ``join()``.

        The store listens before any rank is asked to join, so no rank's connection is refused:
        a refused one is retried after a back-off of about half a second (ARCHITECTURE, "Rank 0
        hosts the rendezvous before the ranks join").
        """
        import ray

        self._store = None  # a previous start's store, if any: closed
        self._store = dist.TCPStore(ray.util.get_node_ip_address(), 0, self.group_size, is_master=True,
                                    timeout=self._collective_timeout(), wait_for_workers=False)
        return Rendezvous(ray.util.get_node_ip_address(), self._store.port)

    def _collective_timeout(self) -> datetime.timedelta:
        # The same timeout bounds the rendezvous and every collective: a rank whose peer hangs
        # fails on its own after about hang_timeout_s instead of torch's default 30 minutes,
        # never below join_timeout_s, the rendezvous's (room for a loaded machine).
        return datetime.timedelta(seconds=collective_timeout_s(self.spec.fault_tolerance))

    def _join(self, master_addr: str, master_port: int) -> None:
        # What exists now (modules, this actor, caches) outlives the attempt: freezing it keeps
        # reset()'s collection to what the attempt made (0.17 s -> 0.01 s of a restart's teardown).
        gc.freeze()
        if self.spec.resources.use_gpu:
            # Ray sets CUDA_VISIBLE_DEVICES per actor, so the assigned GPU is device 0 here.
            torch.cuda.set_device(0)
            if self.spec.training.deterministic:
                _deterministic_cuda()
            enable_recorder()  # read when the NCCL group is made: the dump a hang keeps (rank/nccl_trace.py)
        t0 = time.monotonic()
        timeout = self._collective_timeout()
        store = self._store if self._store is not None else dist.TCPStore(
            master_addr, master_port, self.group_size, is_master=False, timeout=timeout)
        self._meet = (master_addr, master_port)  # with replicas, also where the group's torchft Manager meets
        dist.init_process_group(  # with replicas: this replica group's ranks only, its own world
            backend="nccl" if self.spec.resources.use_gpu else "gloo",
            store=store,
            rank=self.rank % self.group_size,
            world_size=self.group_size,
            timeout=timeout,
        )
        self.timings["pg_init_s"] = time.monotonic() - t0
