"""A step whose manifest this user may not read is not called corrupt: ``verify`` exits 2 naming
the file and how to fix it, and ``ls``/``status`` show it as ``unreadable``. The permission is
denied for real: the file's mode is 000 and, run as root, the command runs without the
capabilities that let root read past it (``setpriv``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from raytrain_ckpt.checkpoint.format.manifest import Manifest, describe_file
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

_NO_ROOT_READS = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                  "--inh-caps", "-dac_override,-dac_read_search"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    prefix = _NO_ROOT_READS if os.geteuid() == 0 else []
    return subprocess.run([*prefix, sys.executable, "-m", "raytrain_ckpt", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME", "/tmp")))


def test_a_manifest_this_user_may_not_read_is_unreadable_not_corrupt(tmp_path):
    assert os.geteuid() != 0 or shutil.which("setpriv"), "setpriv (util-linux) is needed to drop root's reads"
    layout = CheckpointLayout(tmp_path / "job")
    for step in (1, 2):
        tmp = layout.new_tmp_dir(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.arange(8.0) + step}, checkpoint_id=str(tmp), no_dist=True)
        files = {p.name: describe_file(p) for p in sorted(tmp.iterdir())}
        layout.commit(tmp, Manifest(step=step, world_size=1, dp_size=1, spec_hash="h", files=files))
    manifest = layout.step_dir(2) / "manifest.json"
    manifest.chmod(0)
    try:
        out = _cli("verify", str(layout.step_dir(2)))
        assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr and "CORRUPT" not in out.stdout
        assert str(manifest) in out.stderr and "fix its permissions" in out.stderr
        rows = {r["step"]: r for r in json.loads(_cli("ls", "--json", str(layout.root)).stdout)}
        assert rows[1]["status"] == "valid" and rows[2]["status"] == "unreadable", rows
        assert "Permission denied" in rows[2]["detail"]
    finally:
        manifest.chmod(0o644)
    ok = _cli("verify", str(layout.step_dir(2)))  # readable again: the step itself was intact all along
    assert ok.returncode == 0 and "VALID" in ok.stdout, (ok.stdout, ok.stderr)
