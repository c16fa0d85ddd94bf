"""Export/import pieces without a job: lease files against retention, HF names, shard
planning, the streaming safetensors writer, and the final_export spec checks."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raytrain_ckpt.checkpoint.records import GroupLayout
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.interchange.export import export_checkpoint, parse_size
from raytrain_ckpt.checkpoint.errors import ConversionError
from raytrain_ckpt.checkpoint.interchange.formats import plan_shards, safetensors_header
from raytrain_ckpt.models.hf import hf_name, our_name
from raytrain_ckpt.checkpoint.interchange.importer import import_checkpoint
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.storage.leases import LEASE_TTL_S, FileLease, LeaseFiles, file_leased_steps
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.models import build_model, describe_model
from raytrain_ckpt.spec import SpecError
from raytrain_ckpt.control.preflight import load_spec
from tests.unit.test_checkpoint_layout import _commit


def _actor(root: Path) -> CheckpointActor:
    actor = CheckpointActor(str(root), RetentionPolicy(1))
    asyncio.run(actor.configure(GroupLayout(world_size=2, dp_size=2, spec_hash="h")))
    return actor


def test_file_lease_keeps_a_step_from_retention_until_released(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    _commit(layout, 1)
    actor = _actor(tmp_path)
    with FileLease(tmp_path, 1) as lease:
        assert file_leased_steps(tmp_path) == {1}
        for step in (2, 3):
            actor.committed[step] = layout.verify(_commit(layout, step))
            actor._purge()
        assert sorted(layout.step_dirs()) == [1, 3]          # 2 purged, 1 leased, 3 newest
    assert not lease.path.exists() and file_leased_steps(tmp_path) == set()
    actor._purge()
    assert sorted(layout.step_dirs()) == [3]


def test_a_stale_lease_protects_nothing(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    _commit(layout, 1)
    clock = [0.0]
    reader = LeaseFiles(tmp_path, clock=lambda: clock[0])   # the actor's own clock
    with FileLease(tmp_path, 1, heartbeat_s=3600) as lease:  # a holder that stopped beating
        assert reader.leased_steps() == {1}
        clock[0] += LEASE_TTL_S - 1
        assert reader.leased_steps() == {1}
        clock[0] += 2
        assert reader.leased_steps() == set()
        assert not lease.path.exists()                       # and its file is cleaned up


def test_a_lease_on_a_purged_step_fails_and_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidCheckpoint, match="removed"):
        FileLease(tmp_path, 7).__enter__()
    assert not list((tmp_path / "leases").glob("*.json"))


def test_an_actor_lease_and_a_file_lease_both_count(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    for step in (1, 2, 3):
        _commit(layout, step)
    actor = _actor(tmp_path)
    asyncio.run(actor.acquire("loader", "1", "size"))
    with FileLease(tmp_path, 2):
        actor._purge()
        assert sorted(layout.step_dirs()) == [1, 2, 3]


def test_hf_names_round_trip_and_unknown_names_are_refused() -> None:
    fqns = list(build_model("debug", {"n_layers": 2}).state_dict())
    names = [hf_name(f) for f in fqns]
    assert "model.layers.1.self_attn.k_proj.weight" in names and "lm_head.weight" in names
    assert [our_name(n) for n in names] == fqns
    with pytest.raises(ConversionError, match="--format torch"):
        hf_name("net.0.weight")
    with pytest.raises(ConversionError):
        our_name("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_shard_plan_and_sizes() -> None:
    assert plan_shards([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 << 20 and parse_size("17") == 17
    with pytest.raises(ConversionError, match="max-shard-size"):
        parse_size("lots")
    for nothing in ("0", "0.1B", "-1GB"):
        with pytest.raises(ConversionError, match="at least one byte"):
            parse_size(nothing)


def test_streamed_safetensors_header_reads_with_the_library(tmp_path: Path) -> None:
    a, b = torch.randn(3, 5).to(torch.bfloat16), torch.randn(7).to(torch.bfloat16)
    with open(tmp_path / "x.safetensors", "wb") as f:
        f.write(safetensors_header([("a", (3, 5)), ("b", (7,))], torch.bfloat16))
        for t in (a, b):
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    got = load_file(tmp_path / "x.safetensors")
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def test_hf_export_refuses_a_spec_of_another_shape(tmp_path: Path) -> None:
    torch.save(build_model("debug", {"n_layers": 1}).state_dict(), tmp_path / "m.pt")
    step = import_checkpoint(tmp_path / "m.pt", tmp_path / "imp").path
    assert json.loads((step / "manifest.json").read_text())["step"] == 0
    with pytest.raises(ConversionError, match="does not match the spec"):
        export_checkpoint(step, tmp_path / "o", "hf", "bf16", describe_model("debug"))
    with pytest.raises(ConversionError, match="with-optimizer"):
        export_checkpoint(step, tmp_path / "o", "hf", "bf16", describe_model("debug", {"n_layers": 1}), True)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("extra", "problem"), [
    (["checkpoint.enabled=false"], "checkpoint.final_export: exports the final checkpoint"),
    (["model.name=tests.user_models:tiny_mlp_lm"], "checkpoint.final_export.format: hf needs the built-in Llama"),
])
def test_final_export_spec_problems(extra: list[str], problem: str) -> None:
    with pytest.raises(SpecError) as exc:
        load_spec("jobs/llama_debug_fsdp.yaml", ["checkpoint.final_export.format=hf", *extra])
    assert any(p.startswith(problem) for p in exc.value.problems), exc.value.problems


def test_hf_export_gives_the_same_logits_in_transformers(tmp_path: Path) -> None:
    """The exported directory is a Llama that Hugging Face transformers runs with the same logits."""
    import transformers
    torch.manual_seed(0)
    model = build_model("debug", {"n_layers": 2}).eval()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    step = import_checkpoint(tmp_path / "m.pt", tmp_path / "imp").path
    export_checkpoint(step, tmp_path / "hf", "hf", "fp32", describe_model("debug", {"n_layers": 2}))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)


def _cli_with_file_size_limit(args: list[str], limit: int) -> subprocess.CompletedProcess[str]:
    """``raytrain-ckpt <args>`` (or ``-c CODE``) in a process whose files cannot grow past ``limit``
    bytes: a real write that fails midway (EFBIG, as ENOSPC on a full disk)."""
    import resource
    import signal
    import sys

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    command = args if args[0] == "-c" else ["-m", "raytrain_ckpt", *args]
    return subprocess.run([sys.executable, *command], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[2], preexec_fn=limited)


FINAL_EXPORT = """
import sys
from raytrain_ckpt.checkpoint.interchange.export import final_export
from raytrain_ckpt.control.preflight import load_spec
spec = load_spec("jobs/llama_debug_fsdp.yaml", ["checkpoint.final_export.format=torch",
                                                 f"checkpoint.final_export.dir={sys.argv[2]}"])
print("returned", final_export(spec, sys.argv[1]))
"""


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if " INFO " not in ln and ln.strip()]


def test_export_and_import_onto_a_full_disk_name_the_output_and_leave_nothing(tmp_path: Path) -> None:
    """torch's zip writer answers a failed write with its own RuntimeError: it was reported as a
    damaged checkpoint ('failed while reading it ... verify'), and escaped final_export's handler."""
    torch.save({"w": torch.ones(256 * 1024)}, tmp_path / "m.pt")  # 1 MB
    step = import_checkpoint(tmp_path / "m.pt", tmp_path / "imp").path
    out = _cli_with_file_size_limit(["export", str(step), "--format", "torch", "--out", str(tmp_path / "o")], 200_000)
    assert out.returncode == 1 and _errors(out.stderr) == [
        f"error: export: File too large writing {tmp_path / 'o'}; nothing was written there; free space or pass "
        "another --out"], out.stderr[-3000:]
    out = _cli_with_file_size_limit(["import", str(tmp_path / "m.pt"), "--to", str(tmp_path / "imp2")], 200_000)
    assert out.returncode == 1 and _errors(out.stderr) == [
        f"error: import: File too large writing {tmp_path / 'imp2'}; nothing was written there; free space or pass "
        "another --to"], out.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imp", "imp2", "m.pt"]
    assert list((tmp_path / "imp2").iterdir()) == []                # no step-00000000.tmp-* left behind
    out = _cli_with_file_size_limit(["-c", FINAL_EXPORT, str(tmp_path / "imp"), str(tmp_path / "fe")], 200_000)
    assert out.returncode == 0 and out.stdout.split() == ["returned", "None"], out.stderr[-3000:]
    assert "final export failed: [Errno 27] File too large" in out.stderr, out.stderr[-3000:]  # logged; the job stands
    assert not (tmp_path / "fe").exists()
