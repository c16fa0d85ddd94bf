"""Which saved entries a trainer of another layout loads, and what it refuses (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties, TensorStorageMetadata

from raytrain_ckpt.checkpoint.errors import CheckpointMismatch

from raytrain_ckpt.checkpoint.recovery.state import _check_fits, _scheduler_source


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


def _optimizers() -> list[tuple[str, object]]:
    from raytrain_ckpt.parallel.local_math import LocalAdamW

    return [("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)),
            ("local adamw", lambda ps: LocalAdamW(ps, lr=1e-3, weight_decay=0.1)),  # what spec adamw builds
            ("adam amsgrad", lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True)),
            ("sgd momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))]


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)  # no state: it never gets a gradient
    return [torch.nn.Parameter(torch.randn(4, 5)), frozen, torch.nn.Parameter(torch.randn(7).double())]


@pytest.mark.parametrize("fill", [True, False], ids=["zeroed", "for-a-load"])
@pytest.mark.parametrize(("name", "make"), _optimizers(), ids=[n for n, _ in _optimizers()])
def test_created_optimizer_state_is_the_one_a_zero_step_creates(name, make, fill):
    """The state made without a step has the entries, dtypes, shapes and values (zeros) that DCP's
    zero-gradient, lr-0 step creates, except Adam's step count (0: no step was taken), and leaves
    the parameters as they were. For a load (``fill=False``) the values are left as allocated:
    only entries, dtypes, shapes and devices must match (the load overwrites them)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from raytrain_ckpt.checkpoint.recovery.state import create_optimizer_state

    ours_params, dcp_params = _params(), _params()
    ours, theirs = make(ours_params), make(dcp_params)
    assert create_optimizer_state(ours, fill)
    _init_optim_state(theirs)
    assert len(ours.state) == len(theirs.state) == 2
    for p, q in zip(ours_params, dcp_params, strict=True):
        assert torch.equal(p, q) and p.grad is None
        mine, dcp = ours.state.get(p, {}), theirs.state.get(q, {})
        assert mine.keys() == dcp.keys()
        for key, value in mine.items():
            assert value.dtype == dcp[key].dtype and value.shape == dcp[key].shape, key
            assert value.device == dcp[key].device, key
            if key == "step":
                assert value.item() == 0 and dcp[key].item() == 1
            elif fill:
                assert torch.equal(value, dcp[key]), key
    assert not create_optimizer_state(ours)  # it has state now: untouched


def test_optimizer_state_is_left_to_dcp_when_not_known():
    """Unknown or configured-away optimizers keep DCP's way (a zero step): nothing is created."""
    from raytrain_ckpt.checkpoint.recovery.state import create_optimizer_state

    assert not create_optimizer_state(torch.optim.RMSprop(_params(), lr=0.1))
    assert not create_optimizer_state(torch.optim.SGD(_params(), lr=0.1))  # no momentum: no state at all
    assert not create_optimizer_state(torch.optim.Adam(_params(), lr=0.1, capturable=True))
    with_grad = _params()
    with_grad[0].grad = torch.ones(4, 5)
    assert not create_optimizer_state(torch.optim.AdamW(with_grad, lr=0.1))


@pytest.mark.parametrize(("name", "make"), _optimizers(), ids=[n for n, _ in _optimizers()])
def test_state_for_a_load_carved_from_a_reserve_trains_as_the_usual_state(name, make):
    """A spare's reserve hands out the optimizer state of a load: each entry is a disjoint,
    aligned view of the reserve's one buffer (memory touched ahead), with the usual entries,
    dtypes and shapes; loaded with the same values, it trains to the same parameters bit for bit."""
    from raytrain_ckpt.checkpoint.recovery.state import StateReserve, create_optimizer_state

    reserve = StateReserve(1 << 16)
    base = reserve._buf.untyped_storage().data_ptr()
    ours_params, usual_params = _params(), _params()
    ours, usual = make(ours_params), make(usual_params)
    assert create_optimizer_state(ours, fill=False, reserve=reserve)
    assert create_optimizer_state(usual, fill=False)
    spans = []
    for p, q in zip(ours_params, usual_params, strict=True):
        mine, theirs = ours.state.get(p, {}), usual.state.get(q, {})
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            assert value.dtype == theirs[key].dtype and value.shape == theirs[key].shape, key
            if key == "step":
                continue
            assert value.untyped_storage().data_ptr() == base, key   # carved from the reserve
            start = value.data_ptr() - base
            assert start % 64 == 0
            spans.append((start, start + value.numel() * value.element_size()))
            value.copy_(torch.arange(value.numel(), dtype=value.dtype).view(value.shape) / 7)  # "the load"
            theirs[key].copy_(value)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and reserve.used == spans[-1][1]
    for params, opt in ((ours_params, ours), (usual_params, usual)):
        for _ in range(2):
            for p in params:
                if p.requires_grad:
                    p.grad = torch.cos(p.detach())
            opt.step()
    for p, q in zip(ours_params, usual_params, strict=True):
        assert torch.equal(p, q)


def test_a_reserve_too_small_hands_out_what_fits_and_allocates_the_rest():
    from raytrain_ckpt.checkpoint.recovery.state import StateReserve, create_optimizer_state

    reserve = StateReserve(4 * 20 + 8)  # the first (4, 5) fp32 moment, not the second
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-3)
    assert create_optimizer_state(opt, fill=False, reserve=reserve)
    base = reserve._buf.untyped_storage().data_ptr()
    inside = [k for p in params if p in opt.state for k, v in opt.state[p].items()
              if k != "step" and v.untyped_storage().data_ptr() == base]
    assert inside == ["exp_avg"] and reserve.used == 80
    assert all(v.shape == p.shape for p in params if p in opt.state for k, v in opt.state[p].items() if k != "step")


def test_a_kept_process_recycles_its_failed_attempts_optimizer_state_by_shape_and_dtype():
    """The next attempt's state for a load reuses the previous state's tensors (pages touched
    already) where shape and dtype match; what matches nothing is allocated as usual."""
    from raytrain_ckpt.checkpoint.recovery.state import StateReserve, create_optimizer_state, optimizer_tensors

    old_params = _params()
    old = torch.optim.AdamW(old_params, lr=1e-3)
    assert create_optimizer_state(old)
    trainer = type("T", (), {"optimizers": [old]})()
    recycled = optimizer_tensors(trainer)
    assert len(recycled) == 4 and all(t.dim() > 0 for t in recycled)  # two moments per trained tensor
    extra = torch.zeros(9)  # a tensor of a shape the new state does not have
    reserve = StateReserve(recycled=[*recycled, extra])
    new_params = _params()
    new = torch.optim.AdamW(new_params, lr=1e-3)
    assert create_optimizer_state(new, fill=False, reserve=reserve)
    got = {v.data_ptr() for p in new_params if p in new.state for k, v in new.state[p].items() if k != "step"}
    assert got == {t.data_ptr() for t in recycled}
    assert reserve.used == 0 and extra.data_ptr() not in got
