"""torchft's Lighthouse (the replicas' quorum) as a Ray actor on the head node.

Every replica's Manager asks it for the quorum of each step; a replica silent for longer than
``heartbeat_ms`` is left out of the next one. That timeout is what a healthy replica waits
after a peer died (``bench/replica_heal.py``: about 2.7 s at torchft's default 5000 ms, 0.3 s at
500 ms). 2000 ms here: shorter than torchft's default, yet long enough that a healthy replica's
heartbeat delayed on a loaded machine is not taken for a death (a healthy group left out of a
quorum would break the membership rule, ``membership.py``). ``JOIN_MS`` is how long a quorum that lost a member of
the previous one waits for it while it still heartbeats: long, so that only a group that is gone
(its processes killed, its heartbeat stopped) is left out, never one that is merely slow.

The actor also holds the membership rule's meeting point (``roster.py``): the healthy groups and a
replacement group meet there at the replacement's rejoin step.
"""

from __future__ import annotations

from typing import Any

import ray

from raytrain_ckpt.replicas.roster import Roster

__all__ = ["HEARTBEAT_MS", "LighthouseActor", "lighthouse_name", "start_lighthouse"]

HEARTBEAT_MS = 2000
JOIN_MS = 30_000
TICK_MS = 50


@ray.remote(num_cpus=0, max_restarts=0)
class LighthouseActor:
    """The quorum server; ``address()`` is what every replica's Manager connects to."""

    def __init__(self, min_replicas: int, heartbeat_ms: int) -> None:
        from torchft._torchft import LighthouseServer

        self._server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=JOIN_MS,
                                        heartbeat_timeout_ms=heartbeat_ms, quorum_tick_ms=TICK_MS)
        self._roster = Roster()

    def address(self) -> str:
        return self._server.address()

    def shutdown(self) -> None:
        self._server.shutdown()

    # the membership rule's meeting point (``roster.Roster``; each call says what it does there)
    def wait_at(self, replica: int, step: int) -> None:
        self._roster.wait_at(replica, step)

    def rejoin_step(self, replica: int) -> int | None:
        return self._roster.rejoin_step(replica)

    def ready(self, replica: int, rank: int) -> None:
        self._roster.ready(replica, rank)

    def is_ready(self, replica: int, ranks: int) -> bool:
        return self._roster.is_ready(replica, ranks)

    def replacing(self, replica: int) -> None:
        self._roster.replacing(replica)

    def rejoined(self, replica: int) -> None:
        self._roster.rejoined(replica)

    def healing(self) -> dict[int, int]:
        return self._roster.healing()


def lighthouse_name(run_id: str, attempt: int) -> str:
    """The Lighthouse actor's name for attempt ``attempt`` of run ``run_id`` (ranks find the roster by it)."""
    return f"lighthouse-{run_id}-{attempt}"


def start_lighthouse(name: str, min_replicas: int = 1, heartbeat_ms: int = HEARTBEAT_MS) -> tuple[Any, str]:
    """Start the quorum server for one run, named ``name`` (its run id), on the head node; returns
    the actor and the address replicas connect to."""
    head = {"node:__internal_head__": 0.001}
    actor = LighthouseActor.options(name=name, resources=head).remote(min_replicas, heartbeat_ms)  # type: ignore[attr-defined]
    return actor, ray.get(actor.address.remote())
