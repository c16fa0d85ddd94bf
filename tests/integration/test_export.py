"""Export and import on real checkpoints written by a real 2-rank job: every exported tensor
equals plain DCP's reading of the step, the HF index matches its files, a torch export
imports back and a job resumes from it, and an export holds its step against a job that keeps
saving and purging."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from raytrain_ckpt.checkpoint.interchange import export as export_mod
from raytrain_ckpt.checkpoint.interchange.export import export_checkpoint
from raytrain_ckpt.checkpoint.errors import ConversionError
from raytrain_ckpt.models.hf import hf_name
from raytrain_ckpt.checkpoint.interchange.importer import import_checkpoint
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.cli.main import main
from raytrain_ckpt.control.controller import JobResult, JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.models import build_model
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
BASE = ["training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "checkpoint.enabled=true",
        "checkpoint.keep_latest_k=null", "fault_tolerance.max_restarts=0"]


def _ok(result: JobResult) -> JobResult:
    assert result.state is JobState.SUCCEEDED, result.error
    return result


def _full(step_dir: Path, tmp: Path) -> dict:
    """The whole checkpoint as plain DCP tooling reads it, in one process."""
    dcp_to_torch_save(step_dir, tmp / "full.pt")
    return torch.load(tmp / "full.pt", weights_only=False)


@pytest.fixture(scope="module")
def trained(ray_cluster, tmp_path_factory) -> tuple[JobResult, Path, dict]:
    """6 steps at 2 ranks, saving at 3 and 6, with a final HF fp16 export."""
    d = tmp_path_factory.mktemp("trained")
    spec = load_spec(DEMO, [*BASE, f"checkpoint.dir={d}", "training.steps=6", "checkpoint.interval_steps=3",
                            "checkpoint.final_export.format=hf", "checkpoint.final_export.dtype=fp16"])
    result = _ok(run_job(spec))
    step = d / spec.name / "step-00000006"
    return result, step, _full(step, d)


def _read_hf(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / fname), framework="pt") as f:
            assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items() if v == fname)
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return index, tensors


def _check_hf(out: Path, full: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    index, tensors = _read_hf(out)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files
    assert all(f == f"model-{i:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files, 1))
    data = sum((out / f).stat().st_size - 8 - struct.unpack("<Q", (out / f).read_bytes()[:8])[0] for f in files)
    assert index["metadata"]["total_size"] == data == sum(t.nbytes for t in tensors.values())
    assert set(tensors) == {hf_name(k) for k in full["model"]}
    for fqn, value in full["model"].items():
        assert torch.equal(tensors[hf_name(fqn)], value.to(dtype)), fqn
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 4 and cfg["num_key_value_heads"] == 2
    return tensors


def test_final_export_and_cli_hf_export_equal_the_checkpoint(trained, tmp_path):
    result, step, full = trained
    final = Path(result.checkpoints["final_export"])
    assert final == step.parent / "export-step-00000006"
    assert "lm_head.weight" in _check_hf(final, full, torch.float16)
    out = tmp_path / "hf"
    # no --spec: the manifest records the job's model section
    assert CheckpointLayout(step.parent).read_manifest(step).model == {"name": "debug", "overrides": {}}
    assert main(["export", str(step.parent), "--out", str(out), "--max-shard-size", "500KB"]) == 0
    tensors = _check_hf(out, full, torch.bfloat16)
    assert len(list(out.glob("*.safetensors"))) > 1
    # and an HF directory imports back under our names
    imported = import_checkpoint(out, tmp_path / "imp")
    back = _full(imported.path, tmp_path)["model"]
    assert {k: v.dtype for k, v in back.items()} == {k: torch.bfloat16 for k in full["model"]}
    assert all(torch.equal(back[k], tensors[hf_name(k)]) for k in full["model"])


def test_torch_export_is_dcp_to_torch_save_of_the_model(trained, tmp_path):
    _, step, full = trained
    r = export_checkpoint(step, tmp_path / "pt", "torch", "fp32", with_optimizer=True)
    assert r.step == 6 and r.files == ["model.pt"] and 0 < r.peak_tensor_bytes < 2 * 256 * 128 * 4 + 1
    saved = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert set(saved["model"]) == set(full["model"])
    assert all(torch.equal(saved["model"][k], v) for k, v in full["model"].items())
    want_optim = {k: v for k, v in full["optim"].items() if k.startswith("state.")}
    got = {k: v for k, v in saved["optim"].items() if k.startswith("state.")}
    assert set(got) == set(want_optim) and all(torch.equal(got[k], v) for k, v in want_optim.items())


def test_torch_export_import_resume_keeps_the_parameters(trained, tmp_path):
    _, step, full = trained
    export_checkpoint(step, tmp_path / "pt", "torch", "fp32")
    imported = import_checkpoint(tmp_path / "pt" / "model.pt", tmp_path / "imp")
    assert imported.path == tmp_path / "imp" / "step-00000000"
    # One step at a learning rate far below float32 resolution: a resumed model keeps its parameters
    # bit for bit, a model that did not load them would still hold its fresh initialisation.
    spec = load_spec(DEMO, [*BASE, f"checkpoint.dir={tmp_path / 'job'}", "training.steps=1",
                            "optimizer.lr=1e-30", f"checkpoint.resume={imported.path}"])
    result = _ok(run_job(spec))
    assert all(r.start_step == 0 for r in result.results)
    after = _full(tmp_path / "job" / spec.name / "step-00000001", tmp_path)
    fresh = build_model("debug").state_dict()
    for k, v in full["model"].items():
        assert torch.equal(after["model"][k], v), k
        assert not torch.equal(fresh[k], v), k
    assert after["train"]["step"] == 1 and int(after["optim"]["state.output.weight.step"]) == 1


def test_export_holds_its_step_while_the_job_saves_and_purges(ray_cluster, tmp_path, monkeypatch):
    spec = load_spec(DEMO, [*BASE, f"checkpoint.dir={tmp_path}", "training.steps=20", "checkpoint.interval_steps=1",
                            "checkpoint.keep_latest_k=1", "checkpoint.mode=sync"])
    layout = CheckpointLayout(tmp_path / spec.name)
    done: list[JobResult] = []
    job = threading.Thread(target=lambda: done.append(run_job(spec)), daemon=True)
    job.start()
    seen: dict[str, object] = {}
    real_read = export_mod._Reader.read

    def slow_read(self, key, dtype=None):
        if not seen:  # first tensor: the step is leased; let the job commit and purge around it
            leased = int(self.path.name.split("-")[1])
            _wait(lambda: max(layout.step_dirs(), default=0) >= leased + 3, 120)
            seen["steps"] = sorted(layout.step_dirs())
            seen["full"] = _full(self.path, tmp_path)
        return real_read(self, key, dtype)

    monkeypatch.setattr(export_mod._Reader, "read", slow_read)
    _wait(lambda: layout.step_dirs(), 120)
    result = None
    for _ in range(20):  # the newest step may be purged between listing it and leasing it: take the next
        step = max(layout.step_dirs())
        try:
            result = export_checkpoint(layout.step_dir(step), tmp_path / "out", "torch", "fp32")
            break
        except ConversionError as exc:
            assert "removed" in str(exc) or "not a valid" in str(exc), exc
    assert result is not None
    # while leased, newer steps committed and retention (keep 1) purged all but the newest and ours
    # (a third directory may be a commit that retention has not yet followed)
    assert seen["steps"][0] == result.step and len(seen["steps"]) <= 3 and seen["steps"][-1] >= result.step + 3
    saved = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in seen["full"]["model"].items())
    # released: the next commit purges it
    _wait(lambda: result.step not in layout.step_dirs() or done, 120)
    job.join(180)
    assert done and done[0].state is JobState.SUCCEEDED, done and done[0].error
    assert result.step not in layout.step_dirs()
    assert not list((layout.root / "leases").glob("*.json"))


def _wait(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("damage", ["missing", "no_manifest", "truncated", "flipped_shard", "corrupt_metadata",
                                    "not_pt"])
def test_cli_rejects_bad_checkpoints_with_one_line(trained, tmp_path, cli_stderr, damage):
    import shutil

    _, step, _ = trained
    bad = tmp_path / "root" / step.name
    shutil.copytree(step, bad)
    args = ["export", str(bad), "--format", "torch", "--out", str(tmp_path / "o")]
    if damage == "missing":
        args[1] = str(tmp_path / "nothing")
    elif damage == "no_manifest":
        (bad / "manifest.json").unlink()
    elif damage == "truncated":
        shard = next(bad.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "flipped_shard":
        shard = next(bad.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01               # same size: only the checksum finds it
        shard.write_bytes(bytes(data))
    elif damage == "corrupt_metadata":
        meta = bad / ".metadata"
        meta.write_bytes(b"\0" * meta.stat().st_size)   # same size: only reading it finds out
    else:
        (tmp_path / "x.pt").write_text("not a checkpoint")
        args = ["import", str(tmp_path / "x.pt"), "--to", str(tmp_path / "imp")]
    assert main(args) == 2
    err = cli_stderr()
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.tmp-*"))
