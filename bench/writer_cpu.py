"""Writer CPU cost per GB: DCP's FileSystemWriter + read-back checksum vs. the one-pass writer.

One process, no Ray, no training: the cost of persisting one rank's staged state (``--mb`` MB
in 16 tensors, staged in a real shared-memory buffer file) to ``--dir``, measured as CPU
seconds (user + system, ``getrusage``) and wall seconds per GB, with a raw write+fsync of the
same bytes as the floor. Each variant runs ``--reps`` times (the same mapping of the buffer);
the median is printed. ``--ranks N`` writes N ranks' states at once, each from its own buffer on
a thread of its own, as a node's writer does for the node's ranks (figures per GB of all of them).

By default each repetition's files are deleted before the next (the next write lands on the
pages just freed). ``--keep`` keeps them until the end, as a job keeps its checkpoints: on a VM
whose fresh pages cost a host fault each, writes into page cache not used recently cost several
times more kernel time. The ``page cache kept`` row is the one-pass writer without dropping its
files from the page cache after the fsync (``POSIX_FADV_DONTNEED``): what the writer did before.

    .venv/bin/python bench/writer_cpu.py [--mb 256] [--ranks 1] [--reps 3] [--dir bench/out] [--keep]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer, shm_dir
from raytrain_ckpt.checkpoint.datapath import localfile
from raytrain_ckpt.checkpoint.datapath.localfile import write_rank_files
from raytrain_ckpt.checkpoint.format.manifest import describe_file
from raytrain_ckpt.checkpoint.datapath.staging import StagedPlanner, map_buffer, map_slots, plan_slots, slot_views


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _measure(fn: Callable[[Path, int], None], out: Path, label: str, reps: int, keep: bool,
             ranks: int) -> tuple[float, float]:
    walls, cpus = [], []
    for i in range(reps):
        d = out / f"{label}-rep{i}"
        shutil.rmtree(d, ignore_errors=True)
        dirs = [d / f"rank{r}" for r in range(ranks)]
        for rank_dir in dirs:
            rank_dir.mkdir(parents=True)
        errors: list[BaseException] = []

        def rank(rank_dir: Path, r: int) -> None:
            try:
                fn(rank_dir, r)
            except BaseException as exc:  # raised below: a failed write is not a figure
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(rank_dir, r)) for r, rank_dir in enumerate(dirs)]
        c0, t0 = _cpu(), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        walls.append(time.perf_counter() - t0)
        cpus.append(_cpu() - c0)
        if errors:
            raise errors[0]
        if not keep:
            shutil.rmtree(d)
    return statistics.median(walls), statistics.median(cpus)


@contextmanager
def _page_cache_kept() -> Iterator[None]:
    """The one-pass writer as it was before it dropped its files from the page cache."""
    saved = localfile._FileSink.drop_cache
    localfile._FileSink.drop_cache = lambda self: None
    try:
        yield
    finally:
        localfile._FileSink.drop_cache = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--ranks", type=int, default=1, help="ranks written at once, each on its own thread (default 1)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="bench/out", help="a real disk, not tmpfs")
    p.add_argument("--keep", action="store_true", help="keep every repetition's files until the end")
    args = p.parse_args()
    if args.ranks < 1 or args.mb < 1 or args.reps < 1:
        p.error("--ranks, --mb and --reps are at least 1")
    out = Path(args.dir).resolve() / "writer_cpu"
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(1024, args.mb * 2**20 // (16 * 1024 * 4)) for i in range(16)}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    central, _ = planner.create_global_plan([planner.create_local_plan()])
    plan = planner.finish_plan(FileSystemWriter(out).prepare_global_plan(central)[0])
    slots, nbytes = plan_slots(state)
    owned = [OwnedBuffer.create(shm_dir() / f"rtc-bench-{os.getpid()}-a0-rank{r}.buf", nbytes)
             for r in range(args.ranks)]
    try:
        for buffer in owned:
            for fqn, view in slot_views(map_buffer(buffer.path, nbytes), slots).items():
                view.copy_(state[fqn])
        _run(args, out, plan, [b.path for b in owned], nbytes, slots)
    finally:
        for buffer in owned:
            buffer.remove()
        shutil.rmtree(out, ignore_errors=True)


def _run(args: argparse.Namespace, out: Path, plan, paths: list[Path], nbytes: int, slots) -> None:
    views = [slot_views(map_buffer(path, nbytes), slots) for path in paths]
    exact = [map_slots(path, nbytes, slots) for path in paths]
    gb = nbytes * len(paths) / 1e9

    def raw(d: Path, rank: int) -> None:
        with open(d / "raw.bin", "wb") as f:
            for t in exact[rank].values():
                f.write(memoryview(t.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    def dcp_writer(d: Path, rank: int) -> None:  # what the writer did before: FileSystemWriter, then read back
        w = FileSystemWriter(d, thread_count=1, sync_files=True, overwrite=False)
        w.set_up_storage_writer(False, rank=0)
        w.write_data(plan, StagedPlanner(views[rank])).wait()
        for f in d.iterdir():
            describe_file(f)

    def one_pass(d: Path, rank: int) -> None:
        write_rank_files(d, plan, StagedPlanner(exact[rank]).resolve_data, 1)

    print(f"{len(paths)} rank(s) at once, {nbytes / 2**20:.0f} MiB each in {len(slots)} tensors, to {out}; "
          f"torch {torch.__version__}, {os.cpu_count()} cores; median of {args.reps}; "
          f"files {'kept' if args.keep else 'deleted'} between reps")
    print(f"{'variant':<46} {'wall s/GB':>10} {'CPU s/GB':>9} {'tput/raw':>9}")
    floor = _measure(raw, out, "raw", args.reps, False, len(paths))
    print(f"{'raw write+fsync':<46} {floor[0] / gb:>10.3f} {floor[1] / gb:>9.3f} {1.0:>9.2f}")
    for i, (name, fn, setting) in enumerate((("DCP FileSystemWriter + read-back CRC-32C", dcp_writer, nullcontext()),
                                             ("one pass (filewrite), page cache kept", one_pass, _page_cache_kept()),
                                             ("one pass (filewrite)", one_pass, nullcontext()))):
        with setting:  # (around all ranks' threads: the patch is process-wide)
            wall, cpu = _measure(fn, out, f"row{i}", args.reps, args.keep, len(paths))
        print(f"{name:<46} {wall / gb:>10.3f} {cpu / gb:>9.3f} {floor[0] / wall:>9.2f}")


if __name__ == "__main__":
    main()
