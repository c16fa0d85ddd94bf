"""What checksum verification adds to a load, and the raw speed of each checksum.

Two gloo ranks save 256 MiB each with DCP into a step committed the way a job commits it
(manifest with every file's size and CRC-32C), then load it back the way a resume does: the
step is verified against its manifest (``size``: sizes, plus the ``.metadata`` checksum and
restricted unpickling; ``checksum``: every file's CRC-32C), then both ranks ``dcp.load`` it
with the safe reader. Prints the median load time of each mode, the fraction checksums add
(target <= 10%), and the raw single-thread throughput of zlib CRC-32, CRC-32C and xxh3-64
on an in-memory buffer. Files are in the page cache (just written): the figures are the CPU
cost of verification, not disk speed.

    .venv/bin/python bench/load_verify.py [--mib-per-rank 256] [--reps 5] [--dir bench/out/load_verify]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from raytrain_ckpt.checkpoint.format.manifest import Manifest, describe_file
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.format.metadata import SafeFileSystemReader, SafeLoadPlanner

_WORLD = 2
_TENSORS = 4


def _state(rank: int, mib: int) -> dict[str, torch.Tensor]:
    n = mib * (1 << 20) // 4 // _TENSORS
    g = torch.Generator().manual_seed(rank)
    return {f"rank{rank}.t{i}": torch.randn(n, generator=g) for i in range(_TENSORS)}


def _rank(rank: int, root: str, mib: int, reps: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=_WORLD)
    warnings.simplefilter("ignore")
    layout = CheckpointLayout(Path(root))
    state = _state(rank, mib)
    tmp = [layout.new_tmp_dir(1) if rank == 0 else None]
    dist.broadcast_object_list(tmp)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp[0], sync_files=True))
    if rank == 0:
        files = {p.name: describe_file(p) for p in tmp[0].iterdir() if p.is_file()}
        layout.commit(tmp[0], Manifest(step=1, world_size=_WORLD, dp_size=_WORLD, spec_hash="bench", files=files))
    dist.barrier()
    target = {k: torch.empty_like(v) for k, v in state.items()}
    for mode in ("size", "checksum") * reps:
        dist.barrier()
        t0 = time.monotonic()
        if rank == 0:
            layout.verify(layout.step_dir(1), mode)   # the CheckpointActor's check before a resume
        dist.barrier()
        dcp.load(target, storage_reader=SafeFileSystemReader(str(layout.step_dir(1))), planner=SafeLoadPlanner())
        dist.barrier()
        if rank == 0:
            results.setdefault(mode, []).append(time.monotonic() - t0)
    assert all(torch.equal(target[k], state[k]) for k in state)
    dist.destroy_process_group()


def _throughput(nbytes: int) -> dict[str, float]:
    import crc32c
    import xxhash

    data = os.urandom(nbytes)
    out = {}
    for name, fn in (("zlib.crc32", zlib.crc32), ("crc32c", crc32c.crc32c), ("xxh3_64", xxhash.xxh3_64_intdigest)):
        fn(data)
        t0 = time.perf_counter()
        for _ in range(3):
            fn(data)
        out[name] = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib-per-rank", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="bench/out/load_verify")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_entry, args=(str(root), args.mib_per_rank, args.reps, 29571, results), nprocs=_WORLD)
        shared = {k: list(v) for k, v in results.items()}
    size, checksum = statistics.median(shared["size"]), statistics.median(shared["checksum"])
    print(f"state: {_WORLD} ranks x {args.mib_per_rank} MiB; torch {torch.__version__}, {os.cpu_count()} cores; "
          f"median of {args.reps}")
    print(f"load, verify_on_load=size:     {size:.3f} s")
    print(f"load, verify_on_load=checksum: {checksum:.3f} s  ({checksum - size:+.3f} s, {(checksum - size) / size:+.1%})")
    for name, gbs in _throughput(args.mib_per_rank << 20).items():
        print(f"raw {name:<11} {gbs:6.2f} GB/s")
    shutil.rmtree(root, ignore_errors=True)


def _rank_entry(rank: int, root: str, mib: int, reps: int, port: int, results) -> None:
    local: dict[str, list[float]] = {}
    _rank(rank, root, mib, reps, port, local)
    for mode, times in local.items():
        results[mode] = times


if __name__ == "__main__":
    main()
