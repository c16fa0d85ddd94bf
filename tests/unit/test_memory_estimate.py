"""The per-rank memory estimate that `validate` prints and that refuses layouts that cannot fit."""

from __future__ import annotations

import pytest

from raytrain_ckpt.cli.main import main
from raytrain_ckpt.models import PRESETS
from raytrain_ckpt.spec import SpecError
from raytrain_ckpt.control.preflight import load_spec
from raytrain_ckpt.control import preflight as environment
from raytrain_ckpt.spec.memory import memory_estimate

GPU_JOB = "jobs/llama_8b_gpu.yaml"


def _estimate(*overrides: str):
    return memory_estimate(load_spec(GPU_JOB, list(overrides)))


def test_state_is_split_over_every_rank():
    est = _estimate()
    shard = PRESETS["8b"].num_params // 8
    assert (est.parameters, est.gradients, est.optimizer) == (4 * shard, 4 * shard, 8 * shard)
    # async: the saved state is copied to host, into two buffers (memory_copies: 2 by default)
    assert est.staging == 2 * (est.parameters + est.optimizer)
    assert _estimate("checkpoint.memory_copies=1").staging == est.parameters + est.optimizer
    half = _estimate("resources.num_workers=4", "parallelism.dp_shard=4")
    assert half.parameters == 4 * (PRESETS["8b"].num_params // 4)


def test_activation_checkpointing_and_micro_batches_change_activations():
    none, sel, full = (_estimate(f"training.activation_checkpointing={m}").activations
                       for m in ("none", "selective", "full"))
    assert full < sel < none
    assert _estimate("training.micro_batch_size=2").activations == 2 * full


def test_sync_saves_stage_nothing_and_sgd_without_momentum_has_no_state():
    est = _estimate("checkpoint.mode=sync", "optimizer.name=sgd", "optimizer.momentum=0")
    assert est.staging == 0 and est.optimizer == 0


def test_a_user_factory_has_no_estimate():
    assert _estimate("model.name=tests.user_models:staged_mlp_lm", "model.overrides={}") is None


def test_a_cpu_layout_that_does_not_fit_is_refused_and_checkpointing_can_fix_it(monkeypatch):
    base = ["resources.use_gpu=false", "resources.gpus_per_worker=null", "checkpoint.dir=/tmp/h7-ckpt",
            "model.overrides.n_layers=2", "training.micro_batch_size=4", "checkpoint.mode=sync",
            "training.seq_len=512"]
    none = _estimate(*base, "training.activation_checkpointing=none")
    full = _estimate(*base, "training.activation_checkpointing=full")
    monkeypatch.setattr(environment, "host_memory_bytes", lambda: (none.device + full.device) // 2)
    with pytest.raises(SpecError, match="needs about .* activations"):
        load_spec(GPU_JOB, base + ["training.activation_checkpointing=none"])
    load_spec(GPU_JOB, base + ["training.activation_checkpointing=full"])


def test_validate_prints_the_estimate(capsys):
    assert main(["validate", GPU_JOB]) == 0
    err = capsys.readouterr().err
    for part in ("memory per rank (estimate)", "parameters", "gradients", "optimizer", "activations", "staging"):
        assert part in err


@pytest.mark.parametrize(("overrides", "held"), [
    ((), True),                                             # a CPU job with checkpointing and spares
    (("fault_tolerance.spare_workers=0",), False),
    (("fault_tolerance.max_restarts=0",), False),          # no restart: no spares
    (("fault_tolerance.reuse_workers=false",), False),
    (("checkpoint.enabled=false",), False),                # a takeover loads nothing
    (("optimizer.name=sgd", "optimizer.momentum=0"), False),  # no optimizer state
])
def test_a_spare_holds_a_ranks_optimizer_state_where_a_takeover_loads_one(overrides, held):
    from raytrain_ckpt.spec.memory import spare_reserve_bytes

    spec = load_spec("jobs/llama_debug_fsdp.yaml", ["fault_tolerance.max_restarts=2", *overrides])
    est = memory_estimate(spec)
    assert spare_reserve_bytes(spec) == est.spare
    assert (est.spare > est.optimizer) if held else est.spare == 0
    assert any(line.lstrip().startswith("spare") for line in est.lines("host RAM")) == held


def test_a_gpu_job_has_no_spare_memory():
    from raytrain_ckpt.spec.memory import spare_reserve_bytes

    assert spare_reserve_bytes(load_spec(GPU_JOB, [])) == 0 and _estimate().spare == 0


def test_the_storage_estimate_counts_the_certified_step_kept_beside_keep_latest_k():
    from raytrain_ckpt.control.preflight import load_spec
    from raytrain_ckpt.spec.memory import storage_line

    base = ["checkpoint.enabled=true", "checkpoint.keep_latest_k=2"]
    off = storage_line(load_spec("jobs/llama_debug_fsdp.yaml", [*base, "training.guard.nonfinite=false",
                                                                   "training.guard.spike=false"]))
    on = storage_line(load_spec("jobs/llama_debug_fsdp.yaml", [*base, "training.guard.nonfinite=true"]))
    assert off.startswith("checkpoint storage (estimate): 3 steps x ") and "certified" not in off
    assert on.startswith("checkpoint storage (estimate): 4 steps x ")
    assert "keep_latest_k=2 + 1 newest certified step (training.guard) + 1 step being written" in on
