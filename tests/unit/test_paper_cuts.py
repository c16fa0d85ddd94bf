"""The paper cuts a new user meets (issue 34): ``export --out model.pt`` writes that file, a
non-finite loss is null in a manifest and ``--json`` is strict, a URI's secret is never printed,
a missing optional package is one ``error:`` line, and nothing is written through a link planted
in a checkpoint root or into a committed step."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest, describe_file
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def _step(root: Path, step: int = 2, loss: float | None = None) -> Path:
    layout = CheckpointLayout(root)
    tmp = layout.new_tmp_dir(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": torch.nn.Linear(4, 3).state_dict()}, checkpoint_id=str(tmp), no_dist=True)
    files = {p.name: describe_file(p) for p in sorted(tmp.iterdir())}
    return layout.commit(tmp, Manifest(step=step, world_size=1, dp_size=1, spec_hash="h", files=files, loss=loss,
                                       eval_loss=loss))


def test_export_torch_to_a_pt_name_writes_that_file(tmp_path, capsys):
    step = _step(tmp_path / "job")
    out = tmp_path / "model.pt"
    assert main(["export", str(step), "--format", "torch", "--out", str(out)]) == 0, capsys.readouterr().err
    assert out.is_file()
    assert set(torch.load(out, weights_only=True)) == {"weight", "bias"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "model.pt"]  # no staging directory left
    assert main(["export", str(step), "--format", "torch", "--out", str(out)]) != 0  # never overwritten
    assert "exists" in capsys.readouterr().err


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_is_null_in_the_manifest_and_json_is_strict(tmp_path, capsys, loss):
    step = _step(tmp_path / "job", loss=loss)
    recorded = json.loads((step / MANIFEST).read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert "loss" not in recorded and "eval_loss" not in recorded  # null (omitted), never NaN
    assert main(["ls", str(tmp_path / "job"), "--json"]) == 0
    json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"bare {c} in --json"))


def test_a_manifest_written_with_a_nan_reads_as_null(tmp_path):
    step = _step(tmp_path / "job")
    text = (step / MANIFEST).read_text().replace('"dp_size"', '"loss": NaN, "dp_size"')
    assert Manifest.from_json(text).loss is None


def test_strict_json_turns_non_finite_numbers_into_null():
    from raytrain_ckpt.cli.status import strict_json

    assert json.loads(strict_json({"a": math.nan, "b": [math.inf, 1.5], "c": Path("/x")})) == \
        {"a": None, "b": [None, 1.5], "c": "/x"}


def test_a_uri_secret_is_never_printed(capsys):
    code = main(["verify", "s3://user:hunter2secret@bkt/job/step-00000001"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:")
    assert "hunter2secret" not in err and "user:***@" in err


def test_a_uri_secret_is_masked_in_log_lines(caplog):
    from raytrain_ckpt.common.logs import MaskSecrets

    record = logging.LogRecord("x", logging.INFO, __file__, 1, "saving to %s", ("s3://u:topsecret@host/b",), None)
    MaskSecrets().filter(record)
    assert record.getMessage() == "saving to s3://u:***@host/b"


def test_a_missing_optional_package_is_one_error_line(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    code = ("import sys; sys.modules['tokenizers'] = None\nfrom raytrain_ckpt.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, "prepare-data", str(tmp_path / "a.jsonl"), "--out",
                          str(tmp_path / "out"), "--vocab-size", "300", "--workers", "1"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "error: this needs the optional package tokenizers" in out.stderr and "raytrain-ckpt[data]" in out.stderr


def test_a_link_planted_as_the_roots_leases_directory_is_never_written_through(tmp_path, capsys):
    step = _step(tmp_path / "job")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "job" / "leases").symlink_to(elsewhere)
    code = main(["export", str(step), "--format", "torch", "--out", str(tmp_path / "m")])
    assert code != 0 and "leases" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []
    assert not (tmp_path / "m").exists()


def test_import_into_a_committed_step_is_refused(tmp_path, capsys):
    step = _step(tmp_path / "job")
    before = sorted(p.name for p in step.iterdir())
    torch.save({"w": torch.ones(3)}, tmp_path / "w.pt")
    assert main(["import", str(tmp_path / "w.pt"), "--to", str(step)]) == 2
    assert "inside the step directory" in capsys.readouterr().err
    assert sorted(p.name for p in step.iterdir()) == before


def test_ls_of_a_root_with_nothing_to_decode_needs_no_reader_process(tmp_path, capsys, monkeypatch):
    """``ls`` starts its reader process early, ahead of its imports; where the system refuses a
    process then (``EAGAIN`` on a loaded login node) that start is only skipped: ``ls`` of a root
    with no step to decode answers, with no traceback."""
    import errno

    from raytrain_ckpt.checkpoint.format import sandbox

    def no_process(*args, **kwargs):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    with sandbox._READER._lock:
        sandbox._READER._stop()
    monkeypatch.setattr(sandbox.subprocess, "Popen", no_process)
    (tmp_path / "job").mkdir()
    assert main(["ls", str(tmp_path / "job")]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(("name", "value"), [("RAYTRAIN_CKPT_READ_LIMITS", "abc"), ("RAYTRAIN_CKPT_PICKLE_BUDGET", "-1"),
                                             ("RAYTRAIN_CKPT_READ_LIMITS", "nan")])
def test_a_mistyped_read_limit_is_a_usage_error_not_a_corrupt_checkpoint(tmp_path, capsys, monkeypatch, name, value):
    """A typo in a read limit's factor made every step read as corrupt (``verify``, ``ls``), and a
    resume moved them all aside as invalid. It is a usage error before anything is read, naming
    the variable and its range; a resume plan that meets it refuses to start, moving nothing."""
    import asyncio

    from raytrain_ckpt.checkpoint.errors import BadEnvironment
    from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
    from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor

    step = _step(tmp_path / "job")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(name, value)
    for command in (["verify", str(step)], ["ls", str(tmp_path / "job")], ["status", str(tmp_path / "job")]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert f"error: {name}=" in err and "use a factor from" in err and "Traceback" not in err, err
    with pytest.raises(BadEnvironment, match=name):  # a job's actor does not start: nothing is judged
        CheckpointActor(str(tmp_path / "job"), RetentionPolicy(None))
    assert sorted(p.name for p in (tmp_path / "job").iterdir() if p.name.startswith("step-")) == [step.name]
    monkeypatch.delenv(name)
    assert main(["verify", str(step)]) == 0


@pytest.mark.parametrize("uri", ["s3://bucket/tokens", "gs://bucket/tokens"])
def test_prepare_data_into_an_object_store_uri_is_refused_and_writes_nothing(tmp_path, monkeypatch, capsys, uri):
    """``--out s3://bucket/x`` made a local folder named ``s3:``: nothing here writes to a store."""
    (tmp_path / "a.txt").write_text("hello world, hello tokens\n")
    monkeypatch.chdir(tmp_path)
    assert main(["prepare-data", "a.txt", "--out", uri, "--vocab-size", "300", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --out {uri}: must be a local directory"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


@pytest.mark.parametrize(("argv", "shown"), [
    (["prepare-data", "a.txt", "--out", "s3:/bucket/tokens", "--vocab-size", "300"], "s3:/bucket/tokens"),
    (["prepare-data", "a.txt", "--out", "gs:bucket/tokens", "--vocab-size", "300"], "gs:bucket/tokens"),
    (["ls", "s3:/bucket/job"], "s3:/bucket/job"),
    (["export", "s3:/bucket/job/step-00000010", "--out", "hf"], "s3:/bucket/job/step-00000010")])
def test_a_store_uri_missing_a_slash_is_refused_not_made_a_local_folder(tmp_path, monkeypatch, capsys, argv, shown):
    """``--out s3:/bucket/x`` (one slash) made a local folder named ``s3:``; as a checkpoint to read it
    said "no such directory". Every command refuses it, naming the URI it meant, and writes nothing."""
    (tmp_path / "a.txt").write_text("hello world, hello tokens\n")
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    fixed = shown.replace(":/", "://", 1) if ":/" in shown else shown.replace(":", "://", 1)
    assert err == f"error: {shown}: looks like a URI missing a slash; write {fixed}\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_clean_buffers_with_an_empty_dir_sweeps_nothing(tmp_path, monkeypatch, capsys):
    """``--dir ''`` (an unset variable in a script) swept the default directory."""
    orphan = tmp_path / "rtc-job-a0-rank0.buf"
    code = ("import os, sys\nfrom pathlib import Path\nfrom raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer\n"
            "OwnedBuffer.create(Path(sys.argv[1]), 4096)\nos._exit(0)")  # its owner dies: an orphan
    made = subprocess.run([sys.executable, "-c", code, str(orphan)], cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert made.returncode == 0 and orphan.exists()
    monkeypatch.setenv("RAYTRAIN_CKPT_SHM_DIR", str(tmp_path))  # the default directory holds it
    for argv in (["--dir", ""], ["--dir="], ["--dir", " "]):
        assert main(["clean-buffers", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: clean-buffers --dir") and "empty" in err, err
    assert orphan.exists()
    assert main(["clean-buffers", "--dry-run"]) == 0 and f"would remove {orphan}" in capsys.readouterr().out
