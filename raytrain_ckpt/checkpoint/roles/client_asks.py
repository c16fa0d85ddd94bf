"""What a rank asks the CheckpointActor and its node's writer outside a save (``ClientAsks``,
the ``CheckpointClient``'s member, and before the client exists, the resume's), and the one
question the CLI asks a running job's actor (``actor_status``). With ``client.py``, the only
calls a rank or the CLI makes to the checkpoint processes.

Each ask returns Ray's reference (the caller waits on it, or not); nothing here imports Ray at
load time.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ClientAsks", "actor_status"]


class ClientAsks:
    """A rank's asks of the CheckpointActor (``actor``) and its node's writer (``writer``)."""

    def __init__(self, actor: Any, writer: Any) -> None:
        self.actor, self.writer = actor, writer

    def certify(self, step: int) -> Any:
        """The training guard certified ``step``: retention keeps the newest certified step."""
        return self.actor.certify.remote(step)

    def acquire(self, holder: str, step: str, verify: bool) -> Any:
        """Lease ``step`` for ``holder`` (a rollback's, as a restart does); the resume point or None."""
        return self.actor.acquire.remote(holder, step, verify)

    def release(self, holder: str) -> Any:
        """Give up ``holder``'s lease."""
        return self.actor.release.remote(holder)

    def start_timeline(self, step: int, path: str, why: str) -> Any:
        """Make ``step`` the head of the timeline: the steps committed after it are moved aside."""
        return self.actor.start_timeline.remote(step, path, why)

    def forget_copy(self, rank: int, step: int) -> Any:
        """This rank refused its in-memory copy of ``step``: the writer forgets it."""
        return self.writer.forget_copy.remote(rank, step)


def actor_status(actor: Any, timeout_s: float) -> Any:
    """A running job's ``ActorStatus``, asked of its CheckpointActor (``status --job``)."""
    import ray

    return ray.get(actor.status.remote(), timeout=timeout_s)
