"""The torch-free ``.metadata`` check gives loading's verdict: real DCP metadata passes, everything
the loading unpickler refuses is refused, and ``ls``/``verify`` judge a real step without torch."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from raytrain_ckpt.checkpoint.format.manifest import Manifest, describe_file
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, UnsafeCheckpoint
from raytrain_ckpt.checkpoint.format.metadata import load_metadata
from raytrain_ckpt.checkpoint.format.unpickling import TORCH_DTYPES, check_metadata_file

REPO = Path(__file__).resolve().parents[2]


def _dcp_step(root: Path, step: int = 3) -> Path:
    """A committed step saved by DCP: tensors of several dtypes and shapes, and non-tensor entries."""
    layout = CheckpointLayout(root)
    tmp = layout.new_tmp_dir(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": step,
             "extra": {"half": torch.ones(5, dtype=torch.bfloat16), "ids": torch.arange(6, dtype=torch.int32),
                       "rng": random.getstate(), "name": "run-a"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    files = {p.name: describe_file(p) for p in sorted(tmp.iterdir())}
    return layout.commit(tmp, Manifest(step=step, world_size=1, dp_size=1, spec_hash="h", files=files))


def test_the_dtype_list_is_the_installed_torchs():
    assert TORCH_DTYPES == {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}


def test_real_dcp_metadata_passes_as_it_loads(tmp_path):
    step = _dcp_step(tmp_path)
    check_metadata_file(step / ".metadata")
    with open(step / ".metadata", "rb") as f:
        assert type(load_metadata(f, "x")).__name__ == "Metadata"


class _RunsCommand:
    def __reduce__(self) -> tuple:
        return os.system, ("true",)


def _metadata_holding_a(obj: object, tmp: Path) -> bytes:
    """Real DCP metadata with ``obj`` smuggled into a field that is unpickled with it."""
    with open(_dcp_step(tmp) / ".metadata", "rb") as f:
        md = load_metadata(f, "x")
    md.planner_data = {"smuggled": obj}
    return pickle.dumps(md)


REFUSED = [
    ("os.system", lambda tmp: pickle.dumps(_RunsCommand()), UnsafeCheckpoint, "posix.system"),
    ("inside real metadata", lambda tmp: _metadata_holding_a(_RunsCommand(), tmp), UnsafeCheckpoint, "posix.system"),
    ("torch.load", lambda tmp: b"\x80\x04ctorch\nload\n.", UnsafeCheckpoint, "torch.load"),
    ("a dtype-like name", lambda tmp: b"\x80\x04ctorch\nfloat99\n.", UnsafeCheckpoint, "torch.float99"),
    ("not metadata", lambda tmp: pickle.dumps({"a": 1}), InvalidCheckpoint, "holds a dict"),
    ("truncated", lambda tmp: _metadata_holding_a(1, tmp)[:-40], InvalidCheckpoint, "unreadable"),
    ("not a pickle", lambda tmp: b"hello world", InvalidCheckpoint, "unreadable"),
]


@pytest.mark.parametrize(("make", "error", "needle"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_what_loading_refuses_the_check_refuses(tmp_path, make, error, needle):
    path = tmp_path / ".metadata"
    path.write_bytes(make(tmp_path / "src"))
    with pytest.raises(error, match=needle):
        check_metadata_file(path)
    with pytest.raises(error):
        load_metadata(io.BytesIO(path.read_bytes()), str(path))


def test_ls_status_and_verify_of_a_real_step_import_no_torch(tmp_path):
    step = _dcp_step(tmp_path / "job")
    code = ("import json, sys\nfrom raytrain_ckpt.cli.main import main\n"
            f"rcs = [main(['ls', {str(step.parent)!r}]), main(['status', {str(step.parent)!r}]),"
            f" main(['verify', {str(step)!r}])]\n"
            "print(json.dumps([rcs, [m for m in ('torch', 'ray') if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert "valid" in out.stdout
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[0, 0, 0], []]
