"""Checkpoint stall benchmark: what a save costs the training loop, and how fast it is durable.

The same state (``--mb`` MB per rank of FSDP-style DTensor shards, ``--ranks`` ranks on a
gloo process group, each rank a Ray actor) is saved by

* ``dcp.save``                      synchronous DCP
* ``dcp.async_save(thread)``        DCP async, stage then write in a thread of the trainer
* ``dcp.async_save(process)``       DCP async, stage then write in a background process
* ``raytrain_ckpt``                 shared-memory staging overlapped with compute, written
                                    by the node's CheckpointWriter, committed by the
                                    CheckpointActor (manifest + atomic rename)
* ``raytrain_ckpt(restart)``        the same, each save the first of a new attempt (what
                                    the save right after a restart costs)

and for each it prints: the stall (time the training thread was blocked), the time to a
durable checkpoint, stall / memcpy of the state, durable throughput / raw write+fsync of the
same bytes, the step-time slowdown of a compute loop while the save persists, and the training
time the save cost a rank in all (the stall plus the steps' time beyond their time without a
save: the slowdown is a rate over the persisting window, this is its total); for
raytrain_ckpt also the CPU seconds per GB of the writer process (beside the slowdown: what the
writer takes from the trainers' cores) and where its time goes (per phase, the last save of
each rank: serialisation, CRC-32C, write calls (on S3: copying into parts and waiting for a
free one), fsync (on S3: the last parts and the completion), report), and the trainer side of
the stall, per save (layout setup: plan, buffer, mapping; the rest of ``save()``; the wait for
the staging copy before the optimizer step; when the staging thread's copy began after
``save()`` was called, how long it took, and the hand-off to the writer after it). For every
mode that trains while it persists, where the lost time went: how long the training threads
were off the CPU beyond their share without a save, beside the CPU that the save's parts used
in that window (the ranks' other threads: a staging copy, DCP's writing thread; our writer
process; the kernel's threads: I/O completion, writeback). On a machine whose cores the
trainers fill, the first is about the sum of the others: a save costs training what it costs
in CPU. Below the table, each raytrain_ckpt mode's lost time per save and slowdown as ratios
to ``dcp.async_save(thread)``'s in the same run (the slowdown is a rate over each mode's own
persisting window, so a save durable sooner shows a higher one for the same CPU). A
restarted rank's new client is created before the timed save, as a restarted rank does while
it sets up.

Each mode runs ``--reps`` times. Right before every repetition the benchmark measures the step
time without a save and the raw write+fsync floor (all ranks at once), and each repetition's
slowdown and tput/raw are taken against its own adjacent measurements: on a shared virtual
disk the floor moves several-fold between minutes, and one floor measured at the start made the
ratio swing with it. Every figure is the median over the repetitions after the first (the
first pays one-off setup: plan, buffer allocation, background process start), with the first
in brackets; the floor's spread over all repetitions is printed below the table.

    .venv/bin/python bench/checkpoint_stall.py [--mb 256] [--ranks 2] [--reps 3] [--dir bench/out]

``--dir s3://bucket/prefix`` benchmarks an object store (credentials and ``AWS_ENDPOINT_URL``
from the environment; ``--local-s3`` starts moto's S3 server on 127.0.0.1 in a process of its
own, at niceness ``--local-s3-nice``, and a bucket for it). The raw floor is then a plain
parallel s3fs upload of the same bytes (every rank streaming its shards to one object), and DCP
writes through its ``FsspecWriter``. With ``--local-s3`` each save is timed once the server is
idle after the floor, and the server's CPU per save is printed (on this machine it shares the
trainers' cores, which a real store does not).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import shutil
import socket
import statistics
import threading
import time
from pathlib import Path

import ray
import stall_targets
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

MODES = ("dcp.save", "dcp.async_save(thread)", "dcp.async_save(process)", "raytrain_ckpt", "raytrain_ckpt(restart)")
PHASES = ("serialize_s", "checksum_s", "sums_s", "write_calls_s", "fsync_s", "report_s", "cpu_s")


class BenchRank:
    """One rank: a sharded state, a compute loop standing in for forward/backward, and the savers."""

    def __init__(self, rank: int, world: int, mb: int, out: str, step_ms: float, lead_steps: int = 3) -> None:
        self.rank, self.world, self.mb, self.lead_steps = rank, world, mb, lead_steps
        self.remote = "://" in out
        self.out = out.rstrip("/") if self.remote else Path(out)
        self.step_ms = step_ms
        self.client, self.attempt, self.saved, self.setup_s = None, 0, 0, 0.0
        self.copy = {"copy_start_s": 0.0, "copy_s": 0.0, "hand_off_s": 0.0}
        self.t_save = 0.0
        torch.set_num_threads(1)

    def nice(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, addr: str, port: int) -> int:
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=600))
        mesh = init_device_mesh("cpu", (self.world,))
        n_tensors, rows = 16, 1024
        cols = max(1, self.mb * 2**20 * self.world // (n_tensors * rows * 4))
        torch.manual_seed(0)
        self.state = {"model": {f"layer{i}.weight": distribute_tensor(torch.randn(rows, cols), mesh, [Shard(0)])
                                for i in range(n_tensors)}}
        self.local = [t.to_local() for t in self.state["model"].values()]
        self.a = torch.randn(256, 256)
        self._calibrate()
        return sum(t.numel() * t.element_size() for t in self.local)

    def _calibrate(self) -> None:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.3:
            self.a @ self.a
            n += 1
        self.mm_per_step = max(1, int(n / (time.perf_counter() - t0) * self.step_ms / 1000))

    def _step(self, before_update=None) -> float:
        t0 = time.perf_counter()
        for _ in range(self.mm_per_step):  # "forward/backward": reads parameters, allocates
            self.a @ self.a
        if before_update is not None:
            before_update()
        self.local[0][0, :8].add_(1e-6)  # "optimizer step": mutates the state
        return time.perf_counter() - t0

    def baseline(self, steps: int) -> float:
        dist.barrier()
        w0, c0 = time.perf_counter(), time.thread_time()
        times = [self._step() for _ in range(steps)]
        # the share of the loop's wall time its thread was off the CPU without a save (others' work)
        self.base_off = max(0.0, 1 - (time.thread_time() - c0) / (time.perf_counter() - w0))
        return statistics.median(times)

    def memcpy_floor(self) -> float:
        """libc's memcpy of the local state, tensor by tensor, into buffers whose pages are faulted in
        (staging buffers are reused), all ranks at once: what the staging copy does at best."""
        dst = [torch.empty_like(t) for t in self.local]
        for d, s in zip(dst, self.local):
            d.copy_(s)
        dist.barrier()
        t0 = time.perf_counter()
        for d, s in zip(dst, self.local):
            ctypes.memmove(d.data_ptr(), s.data_ptr(), d.nbytes)
        return time.perf_counter() - t0

    def raw_floor(self, rep: int) -> float:
        """Raw write+fsync of the local state's bytes, all ranks at once (measured next to every
        repetition: on a shared virtual disk it moves several-fold between minutes).

        Timed is the second of two such writes. On this VM a write into page cache that was just
        freed runs at several times the speed of one into pages not used recently, and the files
        of a save that stay cached (DCP's) use up the freed pages: the first write leaves the
        second the pages it freed, as the second leaves them to the save measured after it.
        """
        if self.remote:
            return self._raw_upload(rep)
        self._raw_write()
        return self._raw_write()

    def _raw_write(self) -> float:
        raw = self.out / f"raw-{self.rank}.bin"
        dist.barrier()
        t0 = time.perf_counter()
        with open(raw, "wb") as f:
            for s in self.local:
                f.write(memoryview(s.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        dist.barrier()
        write = time.perf_counter() - t0
        raw.unlink()
        return write

    def _raw_upload(self, rep: int) -> float:
        """The object-store floor: every rank streams its bytes to one object with plain s3fs."""
        import fsspec

        fs = fsspec.filesystem(self.out.split("://")[0], skip_instance_cache=True)
        dist.barrier()
        t0 = time.perf_counter()
        with fs.open(f"{self.out}/raw-{rep}-{self.rank}.bin", "wb") as f:
            for s in self.local:
                f.write(memoryview(s.numpy()).cast("B"))
        dist.barrier()
        return time.perf_counter() - t0

    def run(self, mode: str, rep: int, ckpt: dict | None) -> dict[str, float]:
        name = f"{mode.replace('(', '-').replace(')', '')}-{rep}"
        path = f"{self.out}/{name}" if self.remote else self.out / name
        if mode.startswith("raytrain_ckpt") and (self.client is None or mode.endswith("(restart)")):
            self._new_client(ckpt)  # as a restarted rank does while it sets up, before its first step
            for _ in range(self.lead_steps):  # its first steps, each followed by prepare() as in the worker
                dist.barrier()
                self._step()
                self.client.prepare(lambda: self.state)
        dist.barrier()
        self.durable_at: list[float] = []
        t0 = time.perf_counter()
        done = self._start(mode, path, rep, ckpt)
        stall = time.perf_counter() - t0
        steps: list[float] = []
        waits = [0.0]

        def wait_for_copy() -> None:
            w0 = time.perf_counter()
            self.client.before_optimizer_step()
            waits[0] += time.perf_counter() - w0
        hook = wait_for_copy if mode.startswith("raytrain_ckpt") else None
        w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        while not done():
            steps.append(self._step(hook))
        wall, main, proc = time.perf_counter() - w0, time.thread_time() - c0, time.process_time() - p0
        # When the save became durable, taken as it happened (not at the step the loop noticed)
        durable = (self.durable_at[0] if self.durable_at else time.perf_counter()) - t0
        dist.barrier()
        out = {"stall_s": stall + waits[0], "save_s": stall, "durable_s": durable,
               "step_s": statistics.mean(steps) if steps else float("nan"), "steps": len(steps),
               # while it persisted: the training thread off the CPU beyond its share without a save,
               # and the CPU of the rank's other threads (staging copy, DCP's thread, Ray, gloo)
               "cpu": {"off_cpu_s": max(0.0, wall - main - self.base_off * wall), "rank_threads_s": proc - main}}
        if mode.startswith("raytrain_ckpt"):  # the trainer side of the stall
            out["trainer"] = {"setup_s": self.setup_s, "in_save_s": stall, "copy_wait_s": waits[0], **self.copy}
        return out

    def _start(self, mode: str, path: Path, rep: int, ckpt: dict | None):
        # an object store through DCP's own fsspec writer (no fsync: DCP would call os.sync())
        writer = FsspecWriter(str(path), sync_files=False) if self.remote else None
        if mode == "dcp.save":
            dcp.save(self.state, checkpoint_id=str(path), storage_writer=writer)
            self.durable_at.append(time.perf_counter())
            return lambda: True
        if mode.startswith("dcp.async_save"):
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kind = AsyncCheckpointerType.PROCESS if "process" in mode else AsyncCheckpointerType.THREAD
            fut = dcp.async_save(self.state, checkpoint_id=str(path), storage_writer=writer,
                                 async_checkpointer_type=kind)
            fut.add_done_callback(lambda _: self.durable_at.append(time.perf_counter()))
            return fut.done
        return self._start_ours()

    def _new_client(self, ckpt: dict) -> None:
        """A new CheckpointClient of the next attempt (the first: attempt 0), the previous one closed."""
        from raytrain_ckpt.checkpoint.roles.client import CheckpointClient
        from raytrain_ckpt.spec import CheckpointSpec

        if self.client is not None:
            self.client.close()
            self.attempt += 1
        cfg = CheckpointSpec(enabled=True, dir=str(self.out), keep_latest_k=None, interval_steps=50)
        self.client = CheckpointClient(cfg, self.rank, self.attempt, 10**9, ckpt["actor"], ckpt["writer"],
                                       torch.device("cpu"))
        self._time_setup(self.client)

    def _start_ours(self):
        self.setup_s = 0.0
        self.t_save = time.perf_counter()
        self.saved += 1
        step = self.saved
        self.client.save(step, self.state)

        def watch() -> None:
            """Note the moment the step is committed (a thread: the loop only looks once per step)."""
            while self.client._inflight is None:  # the hand-off has not happened yet
                time.sleep(0.001)
            ray.get(self.client.actor.wait_committed.remote(step, 600))
            self.durable_at.append(time.perf_counter())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        return lambda: not watcher.is_alive()

    def _time_setup(self, client) -> None:
        """Time the client's layout setup (plan, buffer allocation, mapping): part of a first save's stall."""
        setup = client._ensure_layout

        def timed(*args):
            t0 = time.perf_counter()
            try:
                layout = setup(*args)
            finally:
                self.setup_s += time.perf_counter() - t0
            for b in layout.buffers:
                self._time_copy(b.staging)
            return layout

        client._ensure_layout = timed

    def _time_copy(self, staging) -> None:
        """Time the staging thread: when its copy starts after ``save()`` began, how long it takes,
        and the hand-off to the writer after it (on the same thread, after the copy)."""
        if getattr(staging, "_bench_timed", False):
            return
        copy, run = staging._copy, staging._run

        def timed_copy(*args):
            t0 = time.perf_counter()
            self.copy["copy_start_s"] = t0 - self.t_save
            try:
                return copy(*args)
            finally:
                self.copy["copy_s"] = time.perf_counter() - t0

        def timed_run(*args):
            run(*args)
            self.copy["hand_off_s"] = time.perf_counter() - self.t_save - self.copy["copy_start_s"] - self.copy["copy_s"]

        staging._copy, staging._run, staging._bench_timed = timed_copy, timed_run, True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=256, help="state size per rank in MB (default 256)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="repetitions per mode (default 3: the median of the last 2)")
    p.add_argument("--step-ms", type=float, default=50.0, help="compute per training step (default 50 ms)")
    p.add_argument("--dir", default="bench/out", help="where checkpoints are written (a real disk, not tmpfs)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--writer-nice", type=int, default=2, help="checkpoint.writer_nice (default 2, the default)")
    p.add_argument("--record", action="store_true",
                   help="write this run's save-path figures to bench/recorded/checkpoint_stall.json (what the README shows)")
    p.add_argument("--lead-steps", type=int, default=10,
                   help="steps a new client trains before its first save (default 10: a first save of an attempt "
                        "comes checkpoint.interval_steps after its start; each step calls prepare() as the worker does)")
    p.add_argument("--every-save", action="store_true", help="print every raytrain_ckpt save's manifest timings")
    p.add_argument("--local-s3", action="store_true",
                   help="with --dir s3://BUCKET/...: start moto's S3 server on 127.0.0.1 and create BUCKET")
    p.add_argument("--local-s3-nice", type=int, default=0, help="niceness of the --local-s3 server (default 0)")
    args = p.parse_args()
    server: LocalS3 | None = None
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if "://" in args.dir:
        out: Path | str = args.dir.rstrip("/")
        if args.local_s3:
            server = LocalS3(out.split("/")[2], args.local_s3_nice)
            env |= server.env
    else:
        out = Path(args.dir).resolve()
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    try:
        ray.init(num_cpus=args.ranks + 1, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env})
        _bench(args, out, server)
    finally:
        ray.shutdown()
        if server is not None:
            server.stop()
        if isinstance(out, Path):
            shutil.rmtree(out, ignore_errors=True)


class LocalS3:
    """moto's S3 server in a process of its own on a free port of 127.0.0.1, with a bucket.

    Its own process, not a thread of the benchmark: it neither shares a GIL with anything
    measured nor runs at the benchmark's priority by accident, and its CPU can be read from
    /proc. ``nice``: its niceness (a real store runs on other machines and takes no CPU from
    the trainers; here it shares their cores).
    """

    def __init__(self, bucket: str, nice: int) -> None:
        import subprocess
        import sys

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=lambda: os.nice(nice))
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        os.environ.update(self.env)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"moto's S3 server did not start on port {port}")
                time.sleep(0.1)
        import boto3

        boto3.client("s3").create_bucket(Bucket=bucket)

    def cpu_s(self) -> float:
        return sum(_cpu_of(self.proc.pid))

    def settle(self) -> float:
        return _settle(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _bench(args: argparse.Namespace, out: Path, server: LocalS3 | None) -> None:
    from raytrain_ckpt.checkpoint.roles.service import CheckpointService
    from raytrain_ckpt.spec import JobSpec

    spec = JobSpec.model_validate({"name": "bench", "resources": {"num_workers": args.ranks},
                                   "checkpoint": {"enabled": True, "dir": str(out), "keep_latest_k": None,
                                                  "writer_nice": args.writer_nice}})
    service = CheckpointService(spec)
    service.acquire(0, spec)  # configures the CheckpointActor with the group's layout (a fresh start)
    node = ray.get_runtime_context().get_node_id()
    ckpt = {"actor": service.actor, "writer": service.writer_for(node)}
    ranks = [ray.remote(BenchRank).options(num_cpus=1).remote(r, args.ranks, args.mb, str(out), args.step_ms,
                                                                    args.lead_steps)
             for r in range(args.ranks)]
    addr, port = ray.get(ranks[0].address.remote())
    nbytes = ray.get([r.setup.remote(addr, port) for r in ranks])
    memcpy = max(ray.get([r.memcpy_floor.remote() for r in ranks]))
    total = sum(nbytes)
    base = statistics.median(ray.get([r.baseline.remote(20) for r in ranks]))
    print(f"state: {args.ranks} ranks x {nbytes[0] / 2**20:.0f} MiB = {total / 2**20:.0f} MiB; "
          f"step compute {base * 1e3:.1f} ms; torch {torch.__version__}, {os.cpu_count()} cores; "
          f"{args.reps} reps per mode")
    floor = "parallel s3fs upload" if isinstance(out, str) else "raw write+fsync"
    writer_pid = ray.get(ckpt["writer"].__ray_call__.remote(lambda self: os.getpid()))
    print(f"niceness: ranks {ray.get(ranks[0].nice.remote())}, writer {os.getpriority(os.PRIO_PROCESS, writer_pid)}, "
          f"benchmark process {os.getpriority(os.PRIO_PROCESS, 0)}")
    print(f"floors: memcpy {memcpy:.3f} s ({nbytes[0] / memcpy / 2**30:.2f} GiB/s per rank); {floor} "
          f"of the same bytes measured before every repetition, to {out}")
    print()
    head = (f"{'mode':<24} {'stall s':>14} {'durable s':>14} {'raw s':>6} {'stall/memcpy':>12} {'tput/raw':>13} "
            f"{'slowdown':>16} {'lost s':>14} {'writer CPU s/GB':>15}")
    print(head)
    print("-" * len(head))
    profiles, floors, costs = {}, [], {}
    for mode in args.modes.split(","):
        reps = [_rep(ranks, mode, i, ckpt, len(floors) + i, server) for i in range(args.reps)]
        floors += [r["raw_s"] for r in reps]
        costs[mode] = _print_row(mode, reps, memcpy, total)
        last = reps[-1]
        if "writer" in last:
            profiles[mode] = last["writer"]
        if last["steps"]:
            cpu = {k: _median_first([r["cpu"].get(k, 0.0) for r in reps if r["steps"]])[0] for k in last["cpu"]}
            print(f"{'':<24} while persisting, summed over ranks (median): training threads off the CPU beyond their "
                  f"share without a save {cpu['off_cpu_s']:.3f} s; CPU of the ranks' other threads "
                  f"{cpu['rank_threads_s']:.3f} s" + (f", of the writer {cpu['writer_s']:.3f} s" if "writer_s" in cpu
                                                      else "") + f", of kernel threads {cpu['kernel_threads_s']:.3f} s")
        if "trainer" in last:
            print(f"{'':<24} trainer side, per save (max over ranks): " + "; ".join(
                ", ".join(f"{k[:-2]} {v:.3f}" for k, v in r["trainer"].items()) for r in reps))
        if last["busy"]:
            print(f"{'':<24} busy after the floor (waited before the save), per save: " + "; ".join(
                ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in r["busy"].items()) for r in reps))
        if "s3_server_cpu_s" in last:
            print(f"{'':<24} S3 server CPU, per save: " + ", ".join(
                f"{r['s3_server_cpu_s'] / (total / 1e9):.2f}" for r in reps) + " s/GB")
    print()
    print(f"{floor} floor over all {len(floors)} repetitions: min {min(floors):.3f} s, median "
          f"{statistics.median(floors):.3f} s, max {max(floors):.3f} s ({total / min(floors) / 2**20:.0f} .. "
          f"{total / max(floors) / 2**20:.0f} MiB/s all ranks)")
    _print_against(costs, "dcp.async_save(thread)")
    for line in stall_targets.report(stall_targets.figures(costs), record=args.record,
                                      object_store=isinstance(out, str)):
        print(line)
    for mode, usage in profiles.items():
        _print_profile(mode, usage, total)
    from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

    layout = CheckpointLayout(f"{out}/bench" if isinstance(out, str) else out / "bench")
    steps = layout.valid_steps()
    for step in sorted(steps)[-1:] if not args.every_save else sorted(steps):
        wall = steps[step].wall
        print(f"raytrain_ckpt, save {step} (manifest wall): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(wall.items())))
    print("stall: training thread blocked (max over ranks); durable: until the checkpoint is complete on disk (taken")
    print("when it completes: DCP's future's callback, a thread waiting for our commit; not at the next step);")
    print("raw s: the floor measured right before each repetition; tput/raw: per repetition, (bytes / durable) /")
    print("(bytes / its own raw floor); slowdown: mean step time while persisting vs. the step time without a save")
    print("measured right before it (nan: no step ran while persisting); lost s: the training time the save cost a")
    print("rank (its stall, plus the steps while persisting beyond the step time without a save; mean over ranks);")
    print("writer CPU s/GB: the writer process over the whole save. While persisting: the training threads' time")
    print("off the CPU beyond their share in the steps without a save, and the CPU other threads used meanwhile.")
    print("Each figure: the median over the repetitions after the first [the first].")
    service.shutdown()


def _median_first(values: list[float]) -> tuple[float, float]:
    """The median over the repetitions after the first (the first alone if there is one), and the first."""
    rest = values[1:] or values
    return statistics.median(rest), values[0]


def _print_against(costs: dict[str, dict[str, float]], peer: str) -> None:
    """Each raytrain_ckpt mode's cost to training against ``peer``'s in this run: the training time
    lost per save (what a rank pays in all) and the slowdown, a rate over each mode's own persisting
    window (a save durable sooner concentrates the same CPU in a shorter window)."""
    if peer not in costs:
        return
    slow, lost = costs[peer]["slowdown"], costs[peer]["lost_s"]
    for mode, row in costs.items():
        s, l = row["slowdown"], row["lost_s"]
        if mode.startswith("raytrain_ckpt"):
            print(f"{mode} against {peer}: training time lost per save {l / lost:.2f} of it, "
                  f"slowdown over its own persisting window {s / slow:.2f} of it")


def _print_row(mode: str, reps: list[dict], memcpy: float, total: int) -> dict[str, float]:
    """Print the mode's row; returns its medians (and the first repetition's stall)."""
    stall, stall0 = _median_first([r["stall_s"] for r in reps])
    durable, durable0 = _median_first([r["durable_s"] for r in reps])
    raw, _ = _median_first([r["raw_s"] for r in reps])
    ratio, ratio0 = _median_first([r["raw_s"] / r["durable_s"] for r in reps])
    slow, slow0 = _median_first([r["step_s"] / r["base_s"] - 1 if r["steps"] else float("nan") for r in reps])
    lost, lost0 = _median_first([r["lost_s"] for r in reps])
    cpu = ""
    if "writer" in reps[0]:
        gb = total / 1e9
        cpu_gb, cpu0 = _median_first([r["writer"]["cpu_s"] / gb for r in reps])
        cpu = f"{cpu_gb:>8.2f} [{cpu0:>4.2f}]"
        figures = {"writer_cpu_s_per_gb": cpu_gb}
    else:
        figures = {}
    print(f"{mode:<24} {stall:>6.3f} [{stall0:>5.2f}] {durable:>6.3f} [{durable0:>5.2f}] {raw:>6.3f} "
          f"{stall / memcpy:>12.2f} {ratio:>6.2f} [{ratio0:>4.2f}] {slow * 100:>7.1f}% [{slow0 * 100:>4.0f}%] "
          f"{lost:>6.3f} [{lost0:>5.2f}] {cpu:>15}")
    return figures | {"slowdown": slow, "lost_s": lost, "stall_s": stall, "first_stall_s": stall0,
                      "stall_per_memcpy": stall / memcpy, "tput_per_raw": ratio}


def _rep(ranks: list, mode: str, rep: int, ckpt: dict, serial: int, server: LocalS3 | None) -> dict:
    """One repetition of ``mode``, with the baseline step time and the raw floor measured right before it."""
    base = statistics.median(ray.get([r.baseline.remote(10) for r in ranks]))
    raw = max(ray.get([r.raw_floor.remote(serial) for r in ranks]))
    ours = mode.startswith("raytrain_ckpt")
    pid = ray.get(ckpt["writer"].__ray_call__.remote(lambda self: os.getpid())) if ours else 0
    busy = {"writer_s": _settle(pid)} if ours else {}
    if server is not None:
        busy["s3_server_s"] = server.settle()
        c0 = server.cpu_s()
    before = _cpu_of(pid) if ours else (0.0, 0.0)
    k0 = _kernel_threads_cpu()
    res = ray.get([r.run.remote(mode, rep, ckpt) for r in ranks])
    kernel = _kernel_threads_cpu() - k0
    steps = [x for x in res if x["steps"]]
    # Training time the save cost a rank: its stall plus what the steps while it persisted took
    # beyond the step time without a save (the slowdown is a rate over that window; this is the total).
    # (The staging waits are inside the steps' time: only the save call itself is added.)
    lost = statistics.mean(x["save_s"] + (x["steps"] * (x["step_s"] - base) if x["steps"] else 0.0) for x in res)
    out = {"stall_s": max(x["stall_s"] for x in res), "durable_s": max(x["durable_s"] for x in res),
           "step_s": statistics.mean(x["step_s"] for x in steps) if steps else float("nan"),
           "steps": sum(x["steps"] for x in res), "raw_s": raw, "base_s": base, "busy": busy, "lost_s": lost,
           "cpu": {k: sum(x["cpu"][k] for x in res) for k in res[0]["cpu"]} | {"kernel_threads_s": kernel}}
    if server is not None:
        out["s3_server_cpu_s"] = server.cpu_s() - c0
    if ours:
        out["trainer"] = {k: max(x["trainer"][k] for x in res) for k in res[0]["trainer"]}
        after = _cpu_of(pid)
        last = ray.get(ckpt["writer"].usage.remote()).last if _has_usage(ckpt["writer"]) else {}
        out["writer"] = {"cpu_s": sum(after) - sum(before), "user_s": after[0] - before[0], "last": last}
        out["cpu"]["writer_s"] = out["writer"]["cpu_s"]
    return out


def _settle(pid: int, busy: float = 0.05, window_s: float = 0.2, limit_s: float = 30.0) -> float:
    """Wait until process ``pid`` has used under ``busy`` of a core over ``window_s``; returns the
    seconds it was still busy (0: idle at once). The floor right before a save takes both cores
    (on S3 for seconds): what it delayed (the writer's work after the previous save, the
    server's after the floor) is finished before the save is timed, and the wait is printed."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        c0 = sum(_cpu_of(pid))
        time.sleep(window_s)
        if sum(_cpu_of(pid)) - c0 < busy * window_s:
            break
    return max(0.0, time.monotonic() - t0 - window_s)


def _kernel_threads_cpu() -> float:
    """CPU seconds of the kernel's threads (kthreadd's children: block I/O completion, writeback,
    memory reclaim), summed, from /proc (their share of a save's cost is the kernel's I/O work)."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[1] == "2" or proc.name == "2":  # the parent pid: kthreadd (2) or kthreadd itself
                total += int((proc / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


def _cpu_of(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process on this node, read from /proc (any writer version)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _has_usage(writer) -> bool:
    """Older writers (to compare a checkout from before) report no usage."""
    try:
        writer.usage
    except AttributeError:
        return False
    return True


def _print_profile(mode: str, usage: dict, total: int) -> None:
    """The writer's CPU per GB and, per phase, its seconds (summed over the ranks it wrote)."""
    gb = total / 1e9
    phases = {p: sum(r.get(p, 0.0) for r in usage["last"].values()) for p in PHASES}
    line = f"{mode} writer: {usage['cpu_s'] / gb:.2f} CPU s/GB (user {usage['user_s'] / gb:.2f})"
    if usage["last"]:
        line += "; phases s/GB (wall, summed over ranks): " + ", ".join(f"{p[:-2]} {v / gb:.3f}"
                                                                        for p, v in phases.items())
    print(line)


if __name__ == "__main__":
    main()
