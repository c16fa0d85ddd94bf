"""Ray names of a job's checkpoint actors: the driver creates them, ``raytrain-ckpt status --job`` finds them;
and the one way to call such an actor while Ray restarts it.

Kept apart from ``service.py`` so that finding an actor imports neither torch nor the actor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["NAMESPACE", "RESTART_POLL_S", "ActorByName", "actor_name", "call_restarting", "writer_name"]

RESTART_POLL_S = 0.2
"""Pause between calls to an actor Ray is restarting (the wait itself is bounded by the caller's timeout)."""

NAMESPACE = "raytrain_ckpt"
"""Ray namespace of a job's named actors, whatever namespace the driver runs in, so that
another process (``raytrain-ckpt status --job``) finds them by name."""


def actor_name(job: str) -> str:
    """The CheckpointActor's Ray name for a job (``raytrain-ckpt status`` finds it by this)."""
    return f"rtc-ckpt-{job}"


def writer_name(job: str, node_id: str) -> str:
    """The Ray name of a job's CheckpointWriter on one node."""
    return f"rtc-writer-{job}-{node_id[:12]}"


class ActorByName:
    """A named actor, looked up in the process that uses it: a handle that is plain data.

    Given to an actor's constructor in place of a handle. Ray keeps a constructor argument
    that holds an actor handle in the object store, so an actor with ``max_restarts`` could
    not restart once that argument is gone (and Ray's core worker says so on every run); a
    name and a namespace are inline data that every restart gets again. The lookup also
    follows the named actor across its own restarts.
    """

    def __init__(self, name: str, namespace: str = NAMESPACE) -> None:
        self.name, self.namespace = name, namespace
        self._handle: Any = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pickling and copying probe dunder attributes: not the actor's
            raise AttributeError(attr)
        if self._handle is None:
            import ray

            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        return getattr(self._handle, attr)

    def __reduce__(self) -> tuple:
        return (ActorByName, (self.name, self.namespace))

    def __repr__(self) -> str:
        return f"ActorByName({self.namespace}/{self.name})"


def call_restarting(call: Callable[[], Any], timeout_s: float, what: str | None = None) -> Any:
    """``ray.get(call())``, called again while the actor is restarting (after a crash Ray brings
    it back, elsewhere when its node was lost), for up to ``timeout_s``; then the error raises.

    Only for idempotent calls: one may have run before the actor went away. ``what`` names the
    call in a warning logged at each retry (None: retried quietly).
    """
    import ray
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(call())
        except ActorUnavailableError as exc:
            if time.monotonic() > deadline:
                raise
            if what is not None:
                logger.warning("%s: actor unavailable (restarting?), retrying: %s", what, str(exc).splitlines()[0])
            time.sleep(RESTART_POLL_S)
