"""Model construction per rank: time and peak host memory, eager (whole model on CPU, then
sharded) against deferred (meta device, sharded, only local shards allocated and initialised).

Each (preset, mode) runs in fresh processes: ``--ranks`` ranks joined in a gloo group, each
building the model with FSDP2 over all ranks exactly as the Trainer does. Printed per rank: the
build time, the peak RSS growth while building (max RSS after minus RSS before; imports and the
process group excluded), the local shard's bytes, and the full fp32 model's bytes beside them.
CPU only; layer counts are cut (``--layers``) so that the large presets fit this machine.

    .venv/bin/python bench/model_init.py [--presets debug small 1b] [--ranks 2] [--layers 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_MODES = ("eager", "meta")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build(preset: str, overrides: dict, mode: str, seed: int = 0) -> torch.nn.Module:
    from raytrain_ckpt.models import build_model
    from raytrain_ckpt.parallel import PartBuilder, build_mesh

    mesh = build_mesh("cpu", dist.get_world_size())
    torch.manual_seed(seed)
    if mode == "meta":
        with torch.device("meta"):
            model = build_model(preset, overrides)
    else:
        model = build_model(preset, overrides)
    return PartBuilder(torch.device("cpu"), torch.float32, seed, mode == "meta")(model, mesh)


def _rank(rank: int, world: int, port: int, preset: str, overrides: dict, mode: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import raytrain_ckpt.parallel  # noqa: F401 - imports are not part of the build

    before = _rss_bytes()
    start = time.monotonic()
    model = _build(preset, overrides, mode)
    seconds = time.monotonic() - start
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    queue.put({"rank": rank, "seconds": seconds, "peak_growth": _peak_rss_bytes() - before,
               "local": local, "full": full})
    dist.barrier()
    dist.destroy_process_group()


def run(preset: str, overrides: dict, mode: str, world: int) -> list[dict]:
    """Build ``preset`` on ``world`` fresh ranks; one result per rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, preset, overrides, mode, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=1200) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["debug", "small", "1b"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2, help="n_layers override (0: the preset's own)")
    ap.add_argument("--json", action="store_true", help="print one JSON line per row instead of the table")
    args = ap.parse_args()
    gib = 1 << 30
    print(f"{'preset':<8} {'mode':<6} {'ranks':>5} {'build s':>8} {'peak RSS growth/rank GiB':>25} "
          f"{'local shard GiB':>16} {'full model GiB':>15}")
    for preset in args.presets:
        overrides = {"n_layers": args.layers} if args.layers else {}
        for mode in _MODES:
            ranks = run(preset, overrides, mode, args.ranks)
            row = {"preset": preset, "mode": mode, "ranks": args.ranks, "layers": args.layers,
                   "seconds": max(r["seconds"] for r in ranks),
                   "peak_growth": max(r["peak_growth"] for r in ranks),
                   "local": max(r["local"] for r in ranks), "full": ranks[0]["full"]}
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            print(f"{preset:<8} {mode:<6} {args.ranks:>5} {row['seconds']:>8.2f} {row['peak_growth'] / gib:>25.3f} "
                  f"{row['local'] / gib:>16.3f} {row['full'] / gib:>15.3f}", flush=True)


if __name__ == "__main__":
    main()
