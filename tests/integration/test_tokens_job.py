"""The token-shard job on a real local Ray: a corpus prepared from this project's docs, eval
losses in the manifests and in ``ls``, best-checkpoint retention, and an exact resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.cli.main import main
from raytrain_ckpt.control.controller import JobResult, JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.cli.prepare import prepare_data
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

JOB = "jobs/llama_debug_tokens.yaml"
REPO = Path(__file__).resolve().parents[2]
SHORT = ["training.steps=8", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2",
         "eval.every_steps=2", "eval.batches=1", "checkpoint.interval_steps=2", "fault_tolerance.max_restarts=0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens-docs")
    meta = prepare_data([REPO / "docs", REPO / "README.md"], out, vocab_size=512, workers=2, progress=False)
    assert meta["vocab_size"] == 512
    return out


def _spec(corpus: Path, ckpt: Path, *extra: str):
    return load_spec(JOB, [*SHORT, f"data.path={corpus}", f"checkpoint.dir={ckpt}", *extra])


def _ok(result: JobResult) -> JobResult:
    assert result.state is JobState.SUCCEEDED, result.error
    return result


def _eval_losses(root: Path) -> dict[int, float | None]:
    return {s: m.eval_loss for s, m in CheckpointLayout(root).valid_steps("size").items()}


@pytest.fixture(scope="module")
def reference(ray_cluster, corpus, tmp_path_factory) -> tuple[JobResult, Path]:
    ckpt = tmp_path_factory.mktemp("ref")
    return _ok(run_job(_spec(corpus, ckpt, "checkpoint.keep_latest_k=null"))), ckpt / "llama-debug-tokens"


def test_eval_loss_is_recorded_in_every_saved_step_and_shown_by_ls(reference, capsys):
    result, root = reference
    losses = _eval_losses(root)
    assert sorted(losses) == [2, 4, 6, 8]
    assert all(v is not None and v > 0 for v in losses.values())
    assert losses[8] < losses[2]  # held-out loss falls as the model learns the docs
    assert sorted(result.losses) == list(range(1, 9))
    capsys.readouterr()
    assert main(["ls", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("step-00000008" in line and f"eval {losses[8]:.4f}" in line for line in lines), lines


def test_keep_best_keeps_the_lowest_eval_loss_besides_the_newest(reference, corpus, tmp_path, capsys):
    _, ref_root = reference
    _ok(run_job(_spec(corpus, tmp_path, "checkpoint.keep_latest_k=1", "checkpoint.keep_best.k=1")))
    ref = _eval_losses(ref_root)
    best = min(ref, key=lambda s: (ref[s], s))
    root = tmp_path / "llama-debug-tokens"
    assert sorted(_eval_losses(root)) == sorted({8, best})
    # the reference kept every step: `export best` ranks all of them as the job's keep_best says
    assert _export(ref_root, "best", tmp_path / "best", capsys) == best
    assert _export(ref_root, "latest", tmp_path / "latest", capsys) == 8


def test_keep_best_by_highest_train_loss_and_export_best(reference, corpus, tmp_path, cli_stderr, capsys):
    ref, _ = reference
    _ok(run_job(_spec(corpus, tmp_path, "checkpoint.keep_latest_k=1", "checkpoint.keep_best.metric=loss",
                      "checkpoint.keep_best.mode=max", "checkpoint.keep_best.k=1")))
    saved = {s: ref.losses[s] for s in (2, 4, 6, 8)}  # the same training as the reference: the same losses
    worst = max(saved, key=lambda s: (saved[s], -s))
    assert worst != 8, saved  # the loss falls: best by max is not the newest, so the two are told apart
    root = tmp_path / "llama-debug-tokens"
    kept = CheckpointLayout(root).valid_steps("size")
    assert sorted(kept) == [worst, 8]
    assert kept[worst].loss == saved[worst] and kept[8].keep_best.metric == "loss"
    assert _export(root, "best", tmp_path / "best", capsys) == worst
    capsys.readouterr()
    assert main(["export", str(root / "step-00000008"), "best", "--format", "torch", "--out", str(tmp_path / "x")]) == 2
    err = cli_stderr()
    assert err.count("\n") == 1 and "step directory; the step selector 'best' picks among the steps" in err


def _export(root: Path, selector: str, out: Path, capsys) -> int:
    """``raytrain-ckpt export <root> <selector>``: the step it reports having exported."""
    capsys.readouterr()
    assert main(["export", str(root), selector, "--format", "torch", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    match = re.search(r"^exported step (\d+) \((.+?)\) to ", printed, re.MULTILINE)
    assert match and (out / "model.pt").is_file(), printed
    assert (selector == "best") == ("the best valid step by" in match.group(2)), match.group(2)
    return int(match.group(1))


def test_killed_rank_resumes_exactly(reference, corpus, tmp_path, monkeypatch):
    ref, ref_root = reference
    # 3 s before the exit: the save of step 4 can still be in flight a step later on a loaded machine
    monkeypatch.setenv(ENV_VAR, "slow@step:rank=1,step=5;exit@step:rank=1,step=5")
    result = _ok(run_job(_spec(corpus, tmp_path, "checkpoint.keep_latest_k=null", "fault_tolerance.max_restarts=1")))
    assert result.attempts == 2 and all(r.start_step == 4 for r in result.results)
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in ref.results]
    assert {s: v for s, v in result.losses.items() if s > 4} == {s: v for s, v in ref.losses.items() if s > 4}
    assert _eval_losses(tmp_path / "llama-debug-tokens") == _eval_losses(ref_root)
    manifest = json.loads((tmp_path / "llama-debug-tokens" / "step-00000008" / "manifest.json").read_text())
    assert manifest["eval_loss"] == _eval_losses(ref_root)[8]
