"""``raytrain-ckpt diff | stats | bisect`` on real DCP step directories."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest, describe_file
from raytrain_ckpt.checkpoint.format.names import step_name
from raytrain_ckpt.cli.main import main


def _write_step(root: Path, step: int, poisoned: bool) -> Path:
    path = root / step_name(step)
    w = torch.full((4, 3), float(step))
    if poisoned:
        w[1, 2] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: intended
        dcp.save({"model.w": w, "model.b": torch.zeros(3), "optim.step": torch.tensor(step)},
                 checkpoint_id=str(path), no_dist=True)
    files = {f.name: describe_file(f) for f in path.iterdir()}
    (path / MANIFEST).write_text(Manifest(step=step, world_size=1, dp_size=1, spec_hash="x", files=files).to_json())
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Ten committed steps; from step 7 on the model holds a NaN."""
    root = tmp_path_factory.mktemp("job") / "job"
    for step in range(1, 11):
        _write_step(root, step, poisoned=step >= 7)
    return root


def test_bisect_finds_the_first_non_finite_step_among_ten(root, capsys):
    assert main(["bisect", str(root), "--check", "finite"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("first non-finite step: 7 (model.w (nan 1, inf 0))")
    assert "4 of 10 step(s) read" in out  # a binary search, not a scan


def test_bisect_of_a_healthy_root_says_so(tmp_path, capsys):
    for step in (1, 2, 3):
        _write_step(tmp_path, step, poisoned=False)
    assert main(["bisect", str(tmp_path), "--check", "finite"]) == 0
    assert "every committed step is finite (3 step(s)" in capsys.readouterr().out


def test_diff_of_a_step_with_itself_is_empty_and_of_two_steps_lists_the_changed_tensors(root, capsys):
    a, b = root / step_name(2), root / step_name(3)
    assert main(["diff", str(a), str(a)]) == 0
    assert capsys.readouterr().out.startswith("identical")
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 tensor(s) differ") and "model.w: norm" in out and "optim.step" in out
    assert "model.b" not in out


def test_diff_delta_is_the_norm_of_the_change_not_the_change_of_the_norm(tmp_path, capsys):
    import json

    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    for step, value in ((1, w), (2, -w)):            # the same norm, a change of 2 * norm(w)
        path = tmp_path / step_name(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model.w": value, "model.v": torch.zeros(step + 1)}, checkpoint_id=str(path), no_dist=True)
        files = {f.name: describe_file(f) for f in path.iterdir()}
        (path / MANIFEST).write_text(Manifest(step=step, world_size=1, dp_size=1, spec_hash="x", files=files).to_json())
    assert main(["diff", str(tmp_path / step_name(1)), str(tmp_path / step_name(2)), "--json"]) == 0
    rows = {r["tensor"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["model.w"]["a"]["norm"] == pytest.approx(rows["model.w"]["b"]["norm"])
    assert rows["model.w"]["delta_norm"] == pytest.approx(2 * float(torch.linalg.vector_norm(w.double())))
    assert rows["model.v"]["delta_norm"] is None      # shapes differ: no change to measure
    assert main(["diff", str(tmp_path / step_name(1)), str(tmp_path / step_name(2))]) == 0
    assert "(|delta| n/a (shapes differ))" in capsys.readouterr().out


def test_stats_of_one_tensor(root, capsys):
    assert main(["stats", str(root / step_name(8)), "--tensor", "model.w", "--json"]) == 0
    import json

    stats = json.loads(capsys.readouterr().out)["model.w"]
    assert (stats["numel"], stats["nan"], stats["sum"]) == (12, 1, "nan")


def test_a_wrong_path_or_tensor_is_one_error_line(root, capsys):
    assert main(["stats", str(root / "nope")]) == 2
    assert main(["stats", str(root / step_name(1)), "--tensor", "model.x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
    assert "not a committed step directory" in err[0] and "--tensor model.x: no such tensor" in err[1]


def test_bisect_judges_a_step_by_its_manifest_fingerprints_when_it_has_them(tmp_path, capsys):
    from raytrain_ckpt.checkpoint.format.fingerprints import merge_shard_sums, shard_sums

    for step in range(1, 6):
        path = _write_step(tmp_path, step, poisoned=False)  # the files are finite...
        w = torch.full((2,), 1.0) if step < 4 else torch.tensor([1.0, math.nan])
        m = Manifest.from_json((path / MANIFEST).read_text())
        recorded = merge_shard_sums([shard_sums({"model.w": w}, {"model.w"})])
        (path / MANIFEST).write_text(m.model_copy(update={"tensors": recorded}).to_json())
    assert main(["bisect", str(tmp_path), "--check", "finite"]) == 1  # ...the manifests say step 4 is not
    assert capsys.readouterr().out.startswith("first non-finite step: 4 (model.w (nan 1, inf 0))")


def test_stats_diff_and_bisect_of_a_damaged_shard_say_so_in_one_line(tmp_path, capsys):
    """A shard whose first bytes were overwritten (a crash mid-write, a bad disk): the chunk is
    refused, DCP wraps that refusal in its own exception, and each command says which step is
    unreadable and what to run, with no traceback."""
    good = _write_step(tmp_path / "job", 1, poisoned=False)
    bad = _write_step(tmp_path / "job", 2, poisoned=False)
    shard = next(bad.glob("*.distcp"))
    shard.write_bytes(b"A" * 400 + shard.read_bytes()[400:])
    for command in (["stats", str(bad)], ["diff", str(good), str(bad)], ["bisect", str(tmp_path / "job"), "--check", "finite"]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert "unreadable" in err and "raytrain-ckpt verify" in err and "Traceback" not in err, (command, err)
