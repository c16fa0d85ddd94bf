"""Evictions: SIGTERM to one rank's process, acted on like a drain notice of its node.

A pod eviction (Kubernetes draining a node, a higher-priority pod taking the place, a spot
node's agent reclaiming it) sends SIGTERM to the pod's processes and SIGKILL after its grace
period. Ray's worker process exits at once on SIGTERM, which would lose the steps since the last
save. A ``TrainWorker`` replaces that handler when it starts (``on_sigterm``, from the actor's
``__init__``, which Ray runs on the process's main thread while the methods run on the actor's
other threads): the first SIGTERM marks the rank evicted, with a deadline of
``time.time() + fault_tolerance.stop_grace_s``, and sets its drain notice. The ranks then agree at
the next step boundary on the step in hand, save and commit it and stop, as for a drain notice;
the driver reads the deadline from the rank's progress (``GroupPoll.evictions``) and records a
preemption of that rank (``PreemptionGuard``), which spends ``max_preemptions``, never
``max_restarts``. Nothing is excluded: Ray stops placing work on a node only when it drains.
A second SIGTERM exits at once, through Ray's own handler, restored by the first.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["on_sigterm"]


def on_sigterm(act: Callable[[], bool]) -> bool:
    """Call ``act`` on the first SIGTERM to this process instead of exiting; returns whether the
    handler was installed (only the main thread can install one).

    The handler before it comes back first, so a second SIGTERM does what it did before. When
    ``act`` returns False (nothing to save: a spare, a process between attempts) the signal goes
    to that handler at once, as if this one had never been installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    before = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, before)
        if act():
            return
        if callable(before):
            before(signum, frame)
        elif before == signal.SIG_DFL:
            signal.raise_signal(signum)

    signal.signal(signal.SIGTERM, handler)
    return True
