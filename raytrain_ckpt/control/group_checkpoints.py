"""The checkpoint processes as the worker group answers for them (``GroupCheckpointing``, a part of
``RayWorkerGroup``): what its start replaced, how long each writer and the actor has been silent,
the save in flight, and replacing the silent ones. Each asks the job's ``CheckpointService``."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["GroupCheckpointing"]


class GroupCheckpointing:
    """The ``WorkerGroup`` capabilities that concern the checkpoint processes (none without checkpointing)."""

    checkpoints: Any
    attempt: int
    spec: Any

    @property
    def replaced(self) -> list[str]:
        """The checkpoint writers and actor this attempt's start replaced because they did not
        answer (``CheckpointService.plan_attempt``), one line each."""
        return self.checkpoints.replaced.get(self.attempt, []) if self.checkpoints is not None else []

    def checkpointing_silences(self) -> dict[str, float]:
        """How long each checkpoint writer and the actor has left its ping unanswered (``control/watch/silence.py``)."""
        return self.checkpoints.fleet.silences(time.monotonic()) if self.checkpoints is not None else {}

    def save_in_flight(self) -> int | None:
        """The oldest step the CheckpointActor has in flight (the save a silent writer holds up), as
        its bulletin last said (None: none or unknown)."""
        from raytrain_ckpt.checkpoint.roles.bulletin import oldest_in_flight

        return oldest_in_flight(self.spec.name) if self.checkpoints is not None else None

    def replace_silent_checkpointing(self, stalled: dict[str, float] | None = None) -> list[str]:
        """Kill and restart the checkpoint writers and actor that do not answer a ping now, and the
        writers of ``stalled`` writes still unmoved past their budget; one line each."""
        return self.checkpoints.fleet.replace_silent(stalled=stalled) if self.checkpoints is not None else []
