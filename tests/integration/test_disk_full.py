"""A full disk on a real filesystem: a tmpfs mounted in a private mount namespace over the
checkpoint directory (needs root and unshare). With two writer threads per rank the save that
runs out of space aborts, the older steps stay intact, training goes on, and the next save
after the space came back commits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("disk_full_job.py")
TMPFS_SIZE = "48M"
"""Room for 4 steps of the debug model (11.5 MB each) when nothing else is there."""


def _isolated(command: str) -> list[str]:
    return ["unshare", "-m", "sh", "-c", command]


@pytest.fixture
def tmpfs_ok(tmp_path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a private tmpfs")
    probe = subprocess.run(_isolated(f"mount -t tmpfs -o size=1M tmpfs {tmp_path}"), capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}")


def test_disk_full_aborts_that_step_only_and_a_later_save_commits(tmpfs_ok, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    command = f"mount -t tmpfs -o size={TMPFS_SIZE} tmpfs {ckpt} && exec {sys.executable} {SCRIPT} {ckpt}"
    out = subprocess.run(_isolated(command), capture_output=True, text=True, timeout=600, cwd=SCRIPT.parents[2])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    assert r["events"]["full_seen"], r                       # the disk really ran full
    assert r["state"] == "SUCCEEDED", r
    # the save that hit ENOSPC never committed; the one before and the ones after did, and verify
    assert "10" in r["failed"] and 10 not in r["committed"], r
    assert {5, 15, 20} <= set(r["committed"]), r
    assert r["valid_checksum"] == r["committed"], r
    assert set(r["loads"].values()) == {"ok"}, r["loads"]  # and every one of them loads
    assert not any(".tmp-" in name for name in r["entries"]), r
    assert r["steps"] == [20, 20]                          # training went on to the end


CHECK_CODE = """
import json, shutil, sys
from pathlib import Path
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from raytrain_ckpt.checkpoint.datapath.sink import check_written

disk = Path(sys.argv[1])
seen = {"raised": 0, "dropped": 0, "caught": 0}
for attempt in range(20):
    out = disk / f"try{attempt}"
    out.mkdir()
    state = {"a": torch.ones(256 * 1024), "b": torch.ones(256 * 1024)}   # 1 MiB each, 1.5 MiB of disk
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    writer = FileSystemWriter(out, thread_count=2, sync_files=True)
    writer.set_up_storage_writer(True, rank=0)
    central = writer.prepare_global_plan(planner.create_global_plan([planner.create_local_plan()])[0])[0]
    plan = planner.finish_plan(central)
    try:
        results = writer.write_data(plan, planner).wait()
    except Exception:                         # OSError, or torch.save's RuntimeError on a short write
        seen["raised"] += 1                   # the calling thread hit ENOSPC: DCP raises it
    else:
        seen["dropped"] += 1                  # only a helper thread failed: DCP returned as if done
        try:
            check_written(plan, results, {p.name: p.stat().st_size for p in out.iterdir()})
        except OSError:
            seen["caught"] += 1
    shutil.rmtree(out)
    if seen["dropped"] >= 2:
        break
print(json.dumps(seen))
"""


def test_a_write_error_in_a_dcp_helper_thread_is_caught(tmpfs_ok, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    code = tmp_path / "check.py"
    code.write_text(CHECK_CODE)
    command = f"mount -t tmpfs -o size=1536K tmpfs {disk} && exec {sys.executable} {code} {disk}"
    out = subprocess.run(_isolated(command), capture_output=True, text=True, timeout=300, cwd=SCRIPT.parents[2])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    seen = json.loads(lines[-1])
    # DCP dropped a helper thread's ENOSPC at least once, and every such write was caught
    assert seen["dropped"] >= 1 and seen["caught"] == seen["dropped"], seen


def test_a_run_on_a_full_disk_is_refused_at_start_in_one_line(tmpfs_ok, tmp_path):
    """A disk filled to the last block (by the job's steps, by anything): the start's probe
    cannot write. One line that says to free space (it said 'make the path writable'), exit 2,
    the committed steps untouched and no probe file left behind."""
    disk = tmp_path / "disk"
    disk.mkdir()
    command = (f"mount -t tmpfs -o size=1M tmpfs {disk} && mkdir -p {disk}/llama-debug-fsdp/step-00000005 && "
               f"echo kept > {disk}/llama-debug-fsdp/step-00000005/manifest.json && "
               f"(dd if=/dev/zero of={disk}/fill bs=4k 2>/dev/null; true) && "
               f"{sys.executable} -m raytrain_ckpt run jobs/llama_debug_fsdp.yaml --set checkpoint.dir={disk} "
               f"--set training.steps=2; echo rc=$?; ls -a {disk}/llama-debug-fsdp; "
               f"cat {disk}/llama-debug-fsdp/step-00000005/manifest.json")
    out = subprocess.run(_isolated(command), capture_output=True, text=True, timeout=300, cwd=SCRIPT.parents[2])
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "No space left on device" in errors[0] and "free space there" in errors[0], errors
    listing = out.stdout.split()
    assert "rc=2" in listing, out.stdout
    assert "step-00000005" in listing and listing[-1] == "kept", out.stdout
    assert not any(name.startswith(".probe-") for name in listing), out.stdout


def test_an_export_from_a_full_checkpoint_disk_goes_without_a_lease(tmpfs_ok, tmp_path):
    """The export lease could not be written on the full disk: the export failed with 'No space
    left ... writing <out>' (the output had room) and left a lease .tmp file behind."""
    import torch

    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    torch.save({"w": torch.ones(1000)}, tmp_path / "w.pt")
    cli = f"{sys.executable} -m raytrain_ckpt"
    command = (f"mount -t tmpfs -o size=1M tmpfs {disk} && {cli} import {tmp_path / 'w.pt'} --to {disk}/imp && "
               f"(dd if=/dev/zero of={disk}/fill bs=4k 2>/dev/null; true) && "
               f"{cli} export {disk}/imp/step-00000000 --format torch --out {out}; echo rc=$?; "
               f"echo leases: $(ls -A {disk}/imp/leases)")
    proc = subprocess.run(_isolated(command), capture_output=True, text=True, timeout=300, cwd=SCRIPT.parents[2])
    assert "rc=0" in proc.stdout.split(), proc.stderr[-3000:]
    assert "exporting without one" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert torch.equal(torch.load(out / "model.pt", weights_only=True)["w"], torch.ones(1000))
    assert proc.stdout.splitlines()[-1] == "leases: .lock", proc.stdout   # no lease .tmp file left behind
