"""What a rank answers from its second actor thread while ``run()`` trains, as a part of
``TrainWorker``: its progress (its own, and its node's ranks' from their files), where its stacks
are read, its NCCL flight recorder, and the drain notices it takes (``preempt()`` from the driver,
a SIGTERM of its own)."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from collections.abc import Callable
from typing import Any

from raytrain_ckpt.common.events import NodeProgress, Progress, RankPlace
from raytrain_ckpt.rank.nccl_trace import rank_trace
from raytrain_ckpt.rank.progress import read_node

logger = logging.getLogger("raytrain_ckpt.rank.worker")  # the worker's lines, as before the split

__all__ = ["SPARE_RANK", "TIERS", "RankAnswers"]

SPARE_RANK = -1
"""The rank of an idle spare worker that no attempt has assigned yet."""
TIERS = ("durable", "ram")
"""A drain's save tiers (``preemption.SavePlan.tier``), in the order the ranks' MAX agrees on."""


class RankAnswers:
    """Uses the worker's ``spec``, ``rank``, ``attempt``, ``run_id`` and its progress."""

    spec: Any
    rank: int
    attempt: int
    run_id: str
    _notice: threading.Event
    _notice_tier: str
    _evicted_until: float | None
    _progress: Progress
    _rollbacks: tuple[Any, ...]

    _prefix: Callable[[], str]

    def _evicted(self) -> bool:
        """The first SIGTERM (a signal handler on the main thread: no log line here, the training
        thread logs the stop): stop like a drain notice within fault_tolerance.stop_grace_s. A spare
        has nothing to save and exits as Ray's handler does."""
        if self.rank == SPARE_RANK:
            return False
        self._evicted_until = time.time() + self.spec.fault_tolerance.stop_grace_s
        self._notice.set()
        return True

    def preempt(self, deadline_unix: float | None, tier: str = "durable") -> None:
        """A node of the group drains (before ``deadline_unix``): save the step in hand (in ``tier``,
        ``preemption.plan_save``) at the next step boundary and stop; called from the second actor
        thread while ``run()`` trains."""
        if not self._notice.is_set():
            logger.warning("%sdrain notice (deadline %s): saving the step in hand (%s tier)", self._prefix(),
                           "none" if deadline_unix is None else f"in {deadline_unix - time.time():.1f}s", tier)
        self._notice_tier = tier
        self._notice.set()

    def where(self) -> RankPlace:
        """This process's pid and Ray node id: where its stacks are read from when the group hangs."""
        import ray

        return RankPlace(os.getpid(), ray.get_runtime_context().get_node_id())

    def node_problem(self, root: str | None) -> str | None:
        """The node health probe's checks, run in this kept process after its reset, before the
        next attempt gives the node ranks again (``control/watch/health.py``: a new process for
        them would cost a Ray worker's start on the restart's path). None: healthy."""
        from raytrain_ckpt.checkpoint.datapath.buffers import node_problem, shm_dir

        return node_problem(shm_dir(), root)

    def nccl_trace(self) -> bytes | str:
        """This rank's NCCL flight recorder or why none (``rank/nccl_trace.py``), while ``run()`` is stuck."""
        return rank_trace()

    def node_progress(self, ranks: list[int]) -> NodeProgress:
        """The progress of ``ranks``, this node's ranks of this attempt, read from their files."""
        return read_node(self.run_id, self.attempt, ranks)

    def progress(self) -> Progress:
        """The last finished step, this attempt's rollbacks so far and an eviction's deadline;
        answered from the second actor thread while ``run()`` trains."""
        return replace(self._shown(), rollbacks=self._rollbacks)

    def _shown(self) -> Progress:
        """The progress with an eviction's deadline, as ``progress()`` answers and the node's file
        shows it (written at the rank's next change of progress, by the training thread)."""
        return replace(self._progress, evicted_until=self._evicted_until)
