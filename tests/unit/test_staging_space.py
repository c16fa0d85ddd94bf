"""A staging buffer is backed in full before any trainer maps it: on a staging file system too
small for it (a real tmpfs, mounted in a private mount namespace: needs root and unshare), the
buffer is refused with one line naming the file system and the space, and nothing is left behind.
On the old code the buffer was handed out sparse, and every rank died of SIGBUS on its first save."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CODE = """
import json, os, sys
from pathlib import Path
from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer
from raytrain_ckpt.checkpoint.errors import StagingFileError, StagingNoSpace
d = Path(sys.argv[1])
out = {}
try:
    OwnedBuffer.create(d / "rtc-x-a0-rank0.buf", 4 << 20)   # 4 MiB on a 1 MiB tmpfs
    out["big"] = "created"
except StagingNoSpace as exc:
    out["big"] = str(exc)
    out["big_is_staging_error"] = isinstance(exc, StagingFileError)
small = OwnedBuffer.create(d / "rtc-x-a0-rank1.buf", 256 << 10)
st = os.stat(small.path)
out["small_backed"] = st.st_blocks * 512 >= 256 << 10
try:
    small.resize(8 << 20)
    out["grown"] = "grown"
except StagingNoSpace as exc:
    out["grown"] = str(exc)
out["small_size_after"] = os.stat(small.path).st_size
out["left"] = sorted(p.name for p in d.iterdir())
print(json.dumps(out))
"""


def _isolated(command: str) -> list[str]:
    return ["unshare", "-m", "sh", "-c", command]


@pytest.fixture
def tmpfs(tmp_path) -> Path:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a private tmpfs")
    probe = subprocess.run(_isolated(f"mount -t tmpfs -o size=1M tmpfs {tmp_path}"), capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}")
    return tmp_path


def test_a_buffer_the_staging_file_system_cannot_hold_is_refused_before_it_is_mapped(tmpfs):
    shm = tmpfs / "shm"
    shm.mkdir()
    command = f"mount -t tmpfs -o size=1M tmpfs {shm} && exec {sys.executable} -c '{CODE}' {shm}"
    out = subprocess.run(_isolated(command), capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["big"] != "created", r                          # never handed out sparse
    assert r["big_is_staging_error"], r                      # a save catches it: training goes on
    assert "4.2 MB staging buffer" in r["big"] and str(shm) in r["big"] and "MB free of" in r["big"], r
    assert "\n" not in r["big"]
    assert r["small_backed"], r                              # what is handed out is allocated
    assert r["grown"] != "grown" and r["small_size_after"] == 256 << 10, r  # a failed growth leaves it as it was
    assert r["left"] == ["rtc-x-a0-rank1.buf"], r            # the refused buffer is gone
