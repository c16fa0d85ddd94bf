"""The training guard's cost per step: the demo job's step with the guard off, with the NaN/Inf
check (one scalar all-reduce per step) and with spike detection too, on real gloo ranks.

Each rank builds the demo's ``Trainer`` (``jobs/llama_debug_fsdp.yaml``), warms up, then runs
``--blocks`` rounds; each round runs ``--steps`` steps in every mode, in turn (off, nonfinite,
spike), so a machine whose speed drifts slows every mode alike. Per mode it prints the median
step time over the rounds and the ratio to the guard-off steps measured in the same rounds, and
the time of the guard's own check (the collective and the judgement) per step, timed around it.

    PYTHONPATH=$PWD .venv/bin/python bench/guard_cost.py [--ranks 2] [--steps 10] [--blocks 5] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("off", "nonfinite", "spike")


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    from raytrain_ckpt.rank.guard import LossGuard
    from raytrain_ckpt.control.preflight import load_spec
    from raytrain_ckpt.rank.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    steps_total = 3 + args.blocks * args.steps * len(MODES)
    spec = load_spec("jobs/llama_debug_fsdp.yaml", [f"training.steps={steps_total}", "training.log_every_steps=1000000",
                                                     f"training.seq_len={args.seq_len}", f"resources.num_workers={world}",
                                                     "training.guard.spike=true", "training.guard.spike_window=5"])
    trainer = Trainer(spec, torch.device("cpu"))
    guards = {"off": None, "nonfinite": LossGuard(spec.training.guard.model_copy(update={"spike": False}), rank, 0,
                                                  torch.device("cpu")),
              "spike": LossGuard(spec.training.guard, rank, 0, torch.device("cpu"))}
    check_s = {m: 0.0 for m in MODES}
    for mode, g in guards.items():  # time the guard's own check, around it
        if g is not None:
            check = g.check

            def timed(step: int, loss: torch.Tensor, check=check, mode=mode) -> None:
                t0 = time.perf_counter()
                check(step, loss)
                check_s[mode] += time.perf_counter() - t0

            g.check = timed
    for _ in range(3):
        trainer.train_step()
    step_s: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.blocks):
        for mode in MODES:
            trainer.guard = guards[mode]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()
            step_s[mode].append((time.perf_counter() - t0) / args.steps)
    if rank == 0:
        out.update({"step_s": step_s, "check_s": {m: check_s[m] / (args.blocks * args.steps) for m in MODES}})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_rank, args=(args.ranks, port, args, out), nprocs=args.ranks, join=True)
    step_s, check_s = out["step_s"], out["check_s"]
    base = statistics.median(step_s["off"])
    print(f"demo job, {args.ranks} gloo ranks, seq_len {args.seq_len}: median step time over {args.blocks} rounds "
          f"of {args.steps} steps per mode")
    print(f"{'guard':12} {'step ms':>10} {'vs off':>8} {'check ms/step':>14} {'check / step':>13}")
    for mode in MODES:
        med = statistics.median(step_s[mode])
        print(f"{mode:12} {med * 1e3:>10.2f} {med / base:>8.3f} {check_s[mode] * 1e3:>14.3f} "
              f"{check_s[mode] / med * 100:>12.2f}%")


if __name__ == "__main__":
    main()
