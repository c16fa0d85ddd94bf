"""Ray names of a job's checkpoint actors: the driver creates them, ``raytrain-ckpt status --job`` finds them.

Kept apart from ``service.py`` so that finding an actor imports neither torch nor the actor.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NAMESPACE", "ActorByName", "actor_name", "writer_name"]

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
