"""Run by test_disk_full.py in its own process, inside a private mount namespace whose
checkpoint directory is a small tmpfs: a real ENOSPC. A filler file takes the space after step
5 committed, so that the save of step 10 runs out of space halfway; the filler is removed as
soon as the disk is full, and the job goes on. Prints one JSON line with what happened."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.conftest, and this checkout's package
os.environ["PYTHONPATH"] = str(REPO)  # inherited by the cluster's processes (see driver._init_ray)
# A private session root and no auth: this cluster must not touch any other Ray on the machine.
from tests.conftest import ray_tmpdir  # noqa: E402

os.environ["RAY_TMPDIR"] = ray_tmpdir()  # removed when this run exits
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)
# the save of step 10 starts only after the filler took the space, and step 15 after it freed it
os.environ["RAYTRAIN_CKPT_FAULTS"] = "slow@step:rank=0,step=7;slow@step:rank=0,step=12"

import ray  # noqa: E402

from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout  # noqa: E402
from raytrain_ckpt.control.driver import run_job  # noqa: E402
from raytrain_ckpt.control.preflight import load_spec  # noqa: E402

LEAVE_FREE = 6 << 20
"""What the filler leaves: about half of one step of the debug model (11.5 MB)."""
DEADLINE_S = 240.0
FREE_AFTER_S = 1.5
"""The save after the full one starts at least 3 s later (the slow fault after step 12)."""


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill_then_free(root: Path, events: dict) -> None:
    """After step 5 committed, take all but LEAVE_FREE. Once a save ran the disk full, give back
    1 MiB at once (room for a step's .metadata and manifest, not for its shards: a write that
    failed must not be committed now) and the rest a little later, before the next save."""
    deadline = time.monotonic() + DEADLINE_S
    while not (root / "step-00000005").is_dir() and time.monotonic() < deadline:
        time.sleep(0.02)
    small, big = root.parent / "filler-small", root.parent / "filler-big"
    small.write_bytes(b"\0" * (1 << 20))
    with open(big, "wb") as f:
        while _free(root) > LEAVE_FREE + (1 << 20):
            f.write(b"\0" * (1 << 20))
            f.flush()
    events["filled_free"] = _free(root)
    while _free(root) > (256 << 10) and time.monotonic() < deadline:
        time.sleep(0.005)
    events["full_seen"] = _free(root) <= (256 << 10)
    small.unlink()
    time.sleep(FREE_AFTER_S)
    big.unlink()
    events["freed_free"] = _free(root)


def _loads(step_dir: Path) -> str:
    """Read every tensor of a committed step with plain DCP: "ok" or the error."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path(ray_tmpdir("rtc-load-")) / "full.pt"
    try:
        dcp_to_torch_save(step_dir, out)
    except Exception as exc:  # reported, not raised: the test names the step that does not load
        return f"{type(exc).__name__}: {exc}"[:300]
    finally:
        out.unlink(missing_ok=True)
        out.parent.rmdir()
    return "ok"


def main(ckpt_dir: str) -> None:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    spec = load_spec(REPO / "jobs" / "llama_debug_fsdp.yaml", [
        "training.steps=20", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2",
        f"checkpoint.dir={ckpt_dir}", "checkpoint.enabled=true", "checkpoint.interval_steps=5",
        "checkpoint.keep_latest_k=null", "checkpoint.writer_threads=2", "fault_tolerance.max_restarts=0"])
    root = Path(ckpt_dir) / spec.name
    root.mkdir(parents=True, exist_ok=True)
    events: dict = {}
    filler = threading.Thread(target=_fill_then_free, args=(root, events), daemon=True)
    filler.start()
    r = run_job(spec)
    filler.join(timeout=10)
    layout = CheckpointLayout(root)
    print(json.dumps({
        "state": r.state.value, "error": r.error, "committed": (r.checkpoints or {}).get("committed"),
        "failed": {str(k): v for k, v in ((r.checkpoints or {}).get("failed") or {}).items()},
        "aborted": [x.checkpoint["aborted"] for x in r.results], "events": events,
        "valid_checksum": sorted(layout.valid_steps("checksum")),
        "entries": sorted(p.name for p in root.iterdir()),
        "steps": [x.steps for x in r.results],
        "loads": {str(s): _loads(layout.step_dir(s)) for s in sorted(layout.valid_steps("checksum"))},
    }))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
