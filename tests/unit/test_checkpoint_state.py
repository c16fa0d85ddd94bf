"""Which saved entries a trainer of another layout loads, and what it refuses (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties, TensorStorageMetadata

from raytrain_ckpt.checkpoint.state import CheckpointMismatch, _check_fits, _scheduler_source


def _tensor_meta(*shape: int) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), [])


SAVED = {"model.layers.0.w": _tensor_meta(4, 4), "optim.state.layers.0.w.exp_avg": _tensor_meta(4, 4),
         "optim.param_groups.layers.0.w.lr": BytesStorageMetadata(),
         "scheduler.stage0.last_epoch": BytesStorageMetadata(), "scheduler.stage1.last_epoch": BytesStorageMetadata()}


def test_matching_entries_pass():
    _check_fits("ckpt", SAVED, {"layers.0.w": torch.zeros(4, 4)},
                {"state.layers.0.w.exp_avg": torch.zeros(4, 4), "param_groups.layers.0.w.lr": 0.1})


def test_a_missing_fqn_is_refused_before_loading():
    with pytest.raises(CheckpointMismatch, match=r"1 entries this rank needs are not in it \(e.g. model.layers.1.w\)"):
        _check_fits("ckpt", SAVED, {"layers.1.w": torch.zeros(4, 4)}, {})


def test_another_shape_is_refused_before_loading():
    with pytest.raises(CheckpointMismatch, match=r"model.layers.0.w has shape \(4, 4\) there and \(8, 4\)"):
        _check_fits("ckpt", SAVED, {"layers.0.w": torch.zeros(8, 4)}, {})


@pytest.mark.parametrize(("key", "saved", "expected"), [
    ("scheduler.stage1", SAVED, "scheduler.stage1"),           # same stage: its own state
    ("scheduler.stage3", SAVED, "scheduler.stage0"),           # more stages than saved: the first
    ("scheduler", SAVED, "scheduler.stage0"),                  # pp=1 loading a pipeline checkpoint
    ("scheduler.stage1", {"scheduler.last_epoch": BytesStorageMetadata()}, "scheduler"),  # FSDP checkpoint
])
def test_each_chunk_finds_a_schedule_state(key, saved, expected):
    assert _scheduler_source(key, saved, "ckpt") == expected


def test_no_schedule_state_is_refused():
    with pytest.raises(CheckpointMismatch, match="no LR scheduler state"):
        _scheduler_source("scheduler", {}, "ckpt")
