"""torchft's Lighthouse (the replicas' quorum) as a Ray actor on the head node.

Every replica's Manager asks it for the quorum of each step; a replica silent for longer than
``heartbeat_ms`` is left out of the next one. That timeout is what a healthy replica waits
after a peer died (``bench/replica_heal.py``: about 2.7 s at torchft's default 5000 ms, 0.3 s at
500 ms), so it is short by default here.
"""

from __future__ import annotations

from typing import Any

import ray

__all__ = ["HEARTBEAT_MS", "LighthouseActor", "start_lighthouse"]

HEARTBEAT_MS = 500
JOIN_MS = 100
TICK_MS = 50


@ray.remote(num_cpus=0, max_restarts=0)
class LighthouseActor:
    """The quorum server; ``address()`` is what every replica's Manager connects to."""

    def __init__(self, min_replicas: int, heartbeat_ms: int) -> None:
        from torchft._torchft import LighthouseServer

        self._server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=JOIN_MS,
                                        heartbeat_timeout_ms=heartbeat_ms, quorum_tick_ms=TICK_MS)

    def address(self) -> str:
        return self._server.address()

    def shutdown(self) -> None:
        self._server.shutdown()


def start_lighthouse(name: str, min_replicas: int = 1, heartbeat_ms: int = HEARTBEAT_MS) -> tuple[Any, str]:
    """Start the quorum server for one run, named ``name`` (its run id), on the head node; returns
    the actor and the address replicas connect to."""
    head = {"node:__internal_head__": 0.001}
    actor = LighthouseActor.options(name=name, resources=head).remote(min_replicas, heartbeat_ms)  # type: ignore[attr-defined]
    return actor, ray.get(actor.address.remote())
