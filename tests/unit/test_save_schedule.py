"""When a step is saved: the interval decides for every step, save_final only adds the last one."""

from __future__ import annotations

import pytest
import torch

from raytrain_ckpt.checkpoint.policy.schedule import SaveSchedule
from raytrain_ckpt.checkpoint.roles.client import CheckpointClient
from raytrain_ckpt.spec import CheckpointSpec

# (interval_steps, save_final, step, total_steps) -> due
TABLE = [
    (5, False, 10, 10, True),     # the last step falls on the interval: saved although save_final=false
    (5, True, 10, 10, True),
    (5, False, 9, 10, False),
    (5, False, 5, 10, True),
    (4, True, 10, 10, True),      # off the interval: save_final adds it
    (4, False, 10, 10, False),
    (None, True, 10, 10, True),
    (None, True, 7, 10, False),
    (None, False, 10, 10, False),
    (1, False, 3, 10, True),
]


@pytest.mark.parametrize(("interval", "final", "step", "total", "due"), TABLE)
def test_due_by_step(interval, final, step, total, due) -> None:
    cfg = CheckpointSpec(enabled=True, interval_steps=interval, save_final=final)
    # no interval_seconds: the decision needs no collective, so no process group here
    client = CheckpointClient(cfg, 0, 0, total, actor=None, writer=None, device=torch.device("cpu"))
    assert client.due(step) is due


@pytest.mark.parametrize(("interval", "final", "step", "clock_due", "due"), [
    (None, False, 3, True, True),     # interval_seconds passed: any step is saved
    (None, False, 10, True, True),    # ... the last one too, whatever save_final says
    (5, False, 3, False, False),
    (5, False, 5, False, True),
])
def test_time_trigger_only_adds_saves(interval, final, step, clock_due, due) -> None:
    assert SaveSchedule(10, interval, final).due(step, clock_due) is due
