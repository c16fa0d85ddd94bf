"""CUDA checkpoint stall benchmark (one GPU, one process, no Ray needed).

The same GPU state (``--gib``) is checkpointed by sync ``dcp.save``, ``dcp.async_save``
(thread) and raytrain_ckpt's ``PinnedCudaStaging`` (a /dev/shm buffer page-locked with
cudaHostRegister, D2H copies on a side stream) followed by the same DCP writer
``FileSystemWriter.write_data`` on a background thread. In a job that writer runs in the
node's CheckpointWriter process; here it is a thread of this process so the benchmark runs
on a GPU box without Ray. Printed per mode: stall (training thread blocked), time to durable,
stall / pinned-D2H floor, durable throughput / raw write+fsync, and the step-time slowdown of
a bf16 matmul loop while the save is in flight.

    python bench/cuda_stall.py [--gib 4] [--dir /tmp/rtc-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from raytrain_ckpt.checkpoint.datapath.staging import PinnedCudaStaging, StagedPlanner, allocate_buffer, map_buffer, plan_slots

DEV = torch.device("cuda", 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--dir", default="/tmp/rtc-bench")
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    n = 16
    numel = int(args.gib * 2**30 / 4 / n)
    state = {"model": {f"layer{i}.weight": torch.randn(numel, device=DEV) for i in range(n)}}
    nbytes = sum(t.numel() * 4 for t in state["model"].values())
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(5):
        step()
    base = statistics.median(step() for _ in range(20))
    d2h, raw = _floors(state, nbytes, out)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; state {nbytes / 2**30:.1f} GiB fp32 on GPU; "
          f"step {base * 1e3:.1f} ms")
    print(f"floors: pinned D2H {d2h:.3f} s ({nbytes / d2h / 2**30:.1f} GiB/s); raw write+fsync {raw:.3f} s "
          f"({nbytes / raw / 2**30:.2f} GiB/s)")
    head = f"{'mode':<22} {'stall s':>9} {'durable s':>10} {'stall/D2H':>10} {'tput/raw':>9} {'slowdown':>9}"
    print(head + "\n" + "-" * len(head))
    ours = _Ours(state, out)
    for mode in ("dcp.save", "dcp.async_save(thread)", "raytrain_ckpt"):
        for rep in range(args.reps):
            r = _run(mode, rep, state, out, step, ours)
        slowdown = statistics.mean(r["steps"]) / base - 1 if r["steps"] else float("nan")
        print(f"{mode:<22} {r['stall']:>9.3f} {r['durable']:>10.3f} {r['stall'] / d2h:>10.3f} "
              f"{raw / r['durable']:>9.2f} {slowdown * 100:>8.1f}%")
    ours.close()
    shutil.rmtree(out, ignore_errors=True)


def _floors(state: dict, nbytes: int, out: Path) -> tuple[float, float]:
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state["model"].values()]
    for h, t in zip(host, state["model"].values()):
        h.copy_(t)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for h, t in zip(host, state["model"].values()):
        h.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(out / "raw.bin", "wb") as f:
        for h in host:
            f.write(memoryview(h.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    raw = time.perf_counter() - t0
    (out / "raw.bin").unlink()
    return d2h, raw


class _Ours:
    """Staging into a registered /dev/shm buffer, then the DCP writer on a background thread."""

    def __init__(self, state: dict, out: Path) -> None:
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=True)
        self.tensors = dict(planner.state_dict)
        slots, self.nbytes = plan_slots(self.tensors)
        self.path = Path("/dev/shm/rtc-bench.buf")
        allocate_buffer(self.path, self.nbytes)
        self.staging = PinnedCudaStaging(map_buffer(self.path, self.nbytes), slots, DEV)
        local = planner.create_local_plan()
        central, self.metadata = planner.create_global_plan([local])
        self.plan = planner.finish_plan(FileSystemWriter(out).prepare_global_plan(central)[0])
        self.out = out

    def start(self, rep: int) -> threading.Event:
        durable = threading.Event()
        path = self.out / f"ours-{rep}"

        def persist() -> None:
            writer = FileSystemWriter(path, thread_count=4, sync_files=True)
            writer.set_up_storage_writer(True, rank=0)
            writer.fs.mkdir(path)
            results = writer.write_data(self.plan, StagedPlanner(self.staging.views)).wait()
            writer.finish(self.metadata, [results])
            durable.set()

        self.staging.start(self.tensors, lambda: threading.Thread(target=persist, daemon=True).start())
        return durable

    def close(self) -> None:
        self.staging.close()
        self.path.unlink(missing_ok=True)


def _run(mode: str, rep: int, state: dict, out: Path, step, ours: _Ours) -> dict:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    wait_s = 0.0
    if mode == "dcp.save":
        dcp.save(state, checkpoint_id=str(out / f"sync-{rep}"))
        done = lambda: True  # noqa: E731
    elif mode.startswith("dcp.async_save"):
        fut = dcp.async_save(state, checkpoint_id=str(out / f"async-{rep}"))
        done = fut.done
    else:
        ev = ours.start(rep)
        done = ev.is_set
    stall = time.perf_counter() - t0
    steps = []
    while not done():
        steps.append(step())
        if mode == "raytrain_ckpt":
            w0 = time.perf_counter()
            ours.staging.wait()          # right before the optimizer would mutate the state
            wait_s += time.perf_counter() - w0
    if mode == "raytrain_ckpt":
        ours.staging.finish()            # the copy thread is joined before the next repetition starts one
    return {"stall": stall + wait_s, "durable": time.perf_counter() - t0, "steps": steps}


if __name__ == "__main__":
    main()
