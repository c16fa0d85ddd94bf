"""Best-checkpoint retention, the eval / data / loss / optimizer spec fields, and user parts by import path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import torch
import yaml

from raytrain_ckpt.checkpoint.format.manifest import METRICS, KeepBestRecord
from raytrain_ckpt.checkpoint.policy.retention import KeepBest, RetentionPolicy, rank_steps
from raytrain_ckpt.cli.main import main
from raytrain_ckpt.spec import SpecError
from raytrain_ckpt.control.preflight import load_spec
from raytrain_ckpt.spec.sections import KeepBestSpec, OptimizerSpec
from raytrain_ckpt.rank.trainer import build_loss, build_optimizer

NAN = float("nan")

# (keep_latest_k, keep_best, committed, metric sequence, expected deletions)
BEST_TABLE = [
    (1, None, [10, 20, 30], {10: 1.0, 20: 0.5}, [10, 20]),                       # off: scores ignored
    (1, ("min", 1), [10, 20, 30], {10: 1.0, 20: 0.5, 30: 0.9}, [10]),            # best (20) + newest (30)
    (1, ("max", 1), [10, 20, 30], {10: 1.0, 20: 0.5, 30: 0.9}, [20]),            # max: 10 is best
    (1, ("min", 2), [10, 20, 30, 40], {10: 1.0, 20: 0.5, 30: 0.7}, [10]),        # 40 unscored: kept as newest only
    (1, ("max", 2), [10, 20, 30, 40], {10: 1.0, 20: 0.5, 30: 0.7}, [20]),
    (1, ("min", 1), [10, 20, 30], {}, [10, 20]),                                  # no scores: nothing is "best"
    (1, ("min", 1), [10, 20, 30], {10: 0.5, 20: 0.5}, [20]),                      # tie: the older step was best first
    (1, ("max", 1), [10, 20, 30], {10: 0.5, 20: 0.5}, [20]),
    (1, ("min", 1), [10, 20, 30], {10: NAN, 20: 0.8}, [10]),                      # NaN never ranks as best
    (1, ("max", 1), [10, 20, 30], {10: NAN, 20: 0.8}, [10]),
    (2, ("min", 1), [10, 20, 30, 40], {10: 0.1, 20: 0.2, 30: 0.3}, [20]),         # 10 + newest two
    (2, ("max", 1), [10, 20, 30, 40], {10: 0.1, 20: 0.2, 30: 0.3}, [10, 20]),     # best is among the newest
    (None, ("min", 1), [10, 20], {10: 0.1}, []),                                  # keep everything
    (1, ("min", 3), [10], {10: 0.1}, []),
    (1, ("max", 2), [10, 20, 30, 40, 50], {10: -1.0, 20: 3.0, 30: 2.0, 40: 2.5}, [10, 30]),
]


@pytest.mark.parametrize("metric", ["eval_loss", "loss"])
@pytest.mark.parametrize("latest,best,committed,scores,expected", BEST_TABLE)
def test_keep_best(latest, best, committed, scores, expected, metric):
    policy = RetentionPolicy(latest, keep_best=KeepBest(metric, *best) if best else None)
    other = "loss" if metric == "eval_loss" else "eval_loss"
    # the other metric ranks the steps the opposite way: the policy must read only its own
    metrics = {s: {metric: v, other: -v} for s, v in scores.items()}
    assert policy.to_delete(committed, metrics=metrics) == expected


def test_keep_best_does_not_override_leases_or_in_flight():
    policy = RetentionPolicy(1, keep_best=KeepBest("eval_loss", "min", 1))
    assert policy.to_delete([10, 20, 30, 40], leased=[20], in_flight=[30], metrics={10: {"eval_loss": 0.1}}) == []


def test_rank_steps_orders_best_first():
    scores = {10: 0.3, 20: None, 30: 0.1, 40: NAN, 50: 0.3}
    assert rank_steps(scores, "min") == [30, 10, 50]
    assert rank_steps(scores, "max") == [10, 50, 30]


def test_spec_metric_names_are_the_ones_a_manifest_records():
    assert set(get_args(KeepBestSpec.model_fields["metric"].annotation)) == set(METRICS)
    assert set(get_args(KeepBestRecord.model_fields["metric"].annotation)) == set(METRICS)


BASE = {"name": "t", "resources": {"num_workers": 2}, "training": {"global_batch_size": 8, "micro_batch_size": 2}}


def _spec(tmp_path: Path, **sections) -> Path:
    data = json.loads(json.dumps(BASE))
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _problems(tmp_path: Path, **sections) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(_spec(tmp_path, **sections))
    return info.value.problems


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    root = tmp_path / "shards"
    root.mkdir()
    (np.arange(5000) % 256).astype(np.uint16).tofile(root / "a.bin")
    return root


BAD = [
    ({"data": {"source": "tests.user_data:missing"}}, "data.source=tests.user_data:missing: data.source factory 'tests.user_data:missing': module 'tests.user_data' has no attribute"),
    ({"data": {"source": "no_such_pkg.mod:f"}}, "cannot import module 'no_such_pkg.mod'"),
    ({"optimizer": {"name": "adam"}}, "optimizer.name: 'adam' is neither adamw, sgd nor a factory path"),
    ({"optimizer": {"name": "tests.user_data:nothing"}}, "optimizer.name: optimizer factory 'tests.user_data:nothing'"),
    ({"optimizer": {"kwargs": {"nesterov": True}}}, "optimizer.kwargs: only used with an optimizer factory"),
    ({"training": {"loss": "mse"}}, "training.loss=mse: 'mse' is neither cross_entropy"),
    ({"training": {"loss": "tests.user_data:nothing"}}, "loss function 'tests.user_data:nothing'"),
    ({"eval": {"every_steps": 0}}, "eval.every_steps=0"),
    ({"checkpoint": {"keep_best": {"k": 2}}}, "checkpoint.keep_best.metric: eval_loss is recorded only when the job "
     "evaluates; add an eval section"),
    ({"checkpoint": {"keep_best": {"metric": "accuracy"}}}, "checkpoint.keep_best.metric"),
    ({"checkpoint": {"keep_best": {"mode": "lowest"}}}, "checkpoint.keep_best.mode"),
    ({"checkpoint": {"keep_best": {"metric": "loss", "k": 0}}}, "checkpoint.keep_best.k"),
    ({"checkpoint": {"keep_best": {"metric": "loss", "size": 2}}}, "checkpoint.keep_best.size"),
    ({"checkpoint": {"keep_best": {"metric": "loss"}, "interval_steps": 5, "save_final": False},
      "training": {"steps": 19, "log_every_steps": 4}},
     "checkpoint.keep_best.metric: loss is recorded every 4 steps (training.log_every_steps) but no save step"),
    ({"data": {"source": "tokens"}}, "data.path: required when source=tokens"),
    ({"data": {"eval_fraction": 0.1}}, "data.eval_fraction: not supported with source=synthetic"),
    ({"data": {"bos_id": 1}}, "data.bos_id: not used with source=synthetic"),
]


@pytest.mark.parametrize("sections,expected", BAD)
def test_bad_fields_name_the_field(tmp_path, sections, expected):
    problems = _problems(tmp_path, **sections)
    assert any(expected in p for p in problems), problems


def test_eval_needs_held_out_data(tmp_path, shards):
    problems = _problems(tmp_path, data={"source": "tokens", "path": str(shards)}, eval={"every_steps": 2})
    assert any(p.startswith("eval: needs held-out data: set data.eval_path or data.eval_fraction") for p in problems)


def test_validate_checks_the_prepared_vocab_against_the_model(tmp_path, shards, capsys):
    (shards / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 4096}))
    path = _spec(tmp_path, data={"source": "tokens", "path": str(shards)},
                 model={"overrides": {"vocab_size": 512}})
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vocab_size 4096 (meta.json) but the model has 512" in err[0]
    assert "set model.overrides.vocab_size >= 4096" in err[0]


def test_valid_tokens_spec_with_eval(tmp_path, shards):
    spec = load_spec(_spec(tmp_path, data={"source": "tokens", "path": str(shards), "eval_fraction": 0.1},
                           eval={"every_steps": 5, "batches": 2}, checkpoint={"keep_best": {"k": 1}}))
    assert spec.eval is not None and spec.eval.batches == 2 and spec.data.path == shards.resolve()


def test_user_loss_is_called_and_checked():
    logits, targets = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    builtin = build_loss("cross_entropy")(logits, targets)
    assert build_loss("tests.user_data:scaled_cross_entropy")(logits, targets) == pytest.approx(2 * float(builtin))
    with pytest.raises(ValueError, match=r"returned Tensor\(6,\); it must return a scalar floating-point tensor"):
        build_loss("tests.user_data:unreduced_loss")(logits, targets)


def test_optimizers_by_name_and_factory():
    params = [torch.nn.Parameter(torch.ones(3))]
    assert isinstance(build_optimizer(OptimizerSpec(name="sgd", lr=0.1), params), torch.optim.SGD)
    opt = build_optimizer(OptimizerSpec(name="tests.user_data:plain_sgd", lr=0.1, kwargs={"momentum": 0.5}), params)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.5
    with pytest.raises(ValueError, match=r"returned list, expected a torch.optim.Optimizer"):
        build_optimizer(OptimizerSpec(name="tests.user_data:not_an_optimizer", lr=0.1), params)


def test_keep_best_accepts_an_auto_interval(tmp_path):
    """An auto interval may come to any length, so the "no save step can rank" check does not apply."""
    spec = load_spec(_spec(tmp_path, checkpoint={"enabled": True, "keep_best": {"metric": "loss"}, "interval_steps": "auto",
                                                 "save_final": False},
                           training={"steps": 19, "log_every_steps": 4}))
    assert spec.checkpoint.interval_steps == "auto" and spec.checkpoint.keep_best.metric == "loss"
