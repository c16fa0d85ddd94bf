"""Goodput under a fault trace: where the wall time of a job with crashes, a hang and a straggler goes.

The demo-sized job (the demo's ~1M-param Llama, FSDP2 over 2 CPU workers, a checkpoint every 5
steps) trains ``--steps`` steps under a seeded fault trace read from a file (``--trace``; one fault
a line: ``KIND rank=R step=S attempt=A``, KIND ``crash``, ``hang`` or ``slow``; a ``slow`` line
makes the rank late at every step of that attempt by ``seconds=T``). Without ``--trace`` a trace is
drawn from ``--seed``: a crash, a hang, another crash and a slow rank, one per attempt, and written
to ``--out-trace`` so the run can be repeated.

The job runs with the spec's default fault tolerance (``hang_timeout_s: auto``), once, and the same
job once with ``hang_timeout_s: 600`` (the previous default), the hang only, to compare detection.
Printed: wall time, goodput (training / wall time, from the goodput ledger), seconds by cause,
lost seconds per fault, each attempt's phases, the hang's detection against the fixed timeout's.

Not measured here: Ray Train's ``TorchTrainer`` under the same trace (its hang detection by default
is the process group's 30-minute collective timeout; ``bench/recovery.py`` compares crash recovery
with it when ``ray[train]`` is installed).

    PYTHONPATH=$PWD .venv/bin/python bench/goodput.py [--steps 40] [--seed 0] [--trace FILE] [--skip-fixed]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import ray

from raytrain_ckpt.faults import ENV_VAR, STAMP_VAR

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "jobs" / "llama_debug_fsdp.yaml"
KINDS = {"crash": "exit", "hang": "hang", "slow": "slow"}


def draw_trace(seed: int, steps: int) -> list[str]:
    """A crash, a hang, a crash and a straggler, one per attempt, at seeded steps past the first save."""
    rng = random.Random(seed)
    out, low = [], 6
    for attempt, kind in enumerate(("crash", "hang", "crash")):
        step = rng.randint(low, min(low + 6, steps - 4))
        out.append(f"{kind} rank={rng.randint(0, 1)} step={step} attempt={attempt}")
        low = step - (step % 5) + 1      # the restart resumes from the last save before it
    out.append(f"slow rank={rng.randint(0, 1)} step=-1 attempt=3 seconds=0.5")
    return out


def plan(trace: list[str]) -> str:
    """The trace as a RAYTRAIN_CKPT_FAULTS plan."""
    faults = []
    for line in trace:
        kind, *args = line.split()
        kv = dict(a.split("=", 1) for a in args)
        extra = f",seconds={kv['seconds']}" if "seconds" in kv else ""
        faults.append(f"{KINDS[kind]}@step:rank={kv['rank']},step={kv['step']},attempt={kv.get('attempt', 0)}{extra}")
    return ";".join(faults)


def run(tmp: Path, steps: int, faults: str, *extra: str) -> tuple[object, float]:
    from raytrain_ckpt.driver import run_job
    from raytrain_ckpt.preflight import load_spec

    os.environ[ENV_VAR] = faults
    os.environ[STAMP_VAR] = str(tmp / "stamp")
    try:
        spec = load_spec(SPEC, [f"training.steps={steps}", f"checkpoint.dir={tmp / 'ckpt'}",
                                "checkpoint.interval_steps=5", "checkpoint.resume=none", "fault_tolerance.max_restarts=5",
                                "training.log_every_steps=100", *extra])
        t0 = time.monotonic()
        result = run_job(spec)
        return result, time.monotonic() - t0
    finally:
        os.environ.pop(ENV_VAR, None)
        os.environ.pop(STAMP_VAR, None)


def report(name: str, result, wall: float) -> None:
    led = result.goodput
    print(f"\n== {name}: {result.state.value}, {result.attempts} attempt(s), {wall:.1f} s wall "
          f"(ledger {led['wall_s']:.1f} s), goodput {100 * led['goodput']:.1f}%")
    for cause, s in sorted(led["seconds"].items(), key=lambda kv: -kv[1]):
        if s >= 0.05:
            print(f"  {cause:<17} {s:7.1f} s  {100 * s / led['wall_s']:5.1f}%")
    for a in led["attempts"]:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in a["phases"].items())
        print(f"  attempt {a['attempt']} ({a['ended_by'] or 'finished'}): {phases}")
    if result.failures:
        restarts = sum(a["phases"].get(c, 0.0) for a in led["attempts"][1:]
                       for c in ("placement", "rendezvous", "load", "first_step"))
        lost = restarts + sum(led["seconds"][c] for c in ("redone", "detection", "teardown", "waiting"))
        print(f"  lost to {len(result.failures)} fault(s): {lost:.1f} s (redone, detection, teardown, back-off, the "
              f"restarts' starts), {lost / len(result.failures):.1f} s per fault")
    for f in result.failures:
        print(f"  {f}"[:200])
    for s in result.stragglers:
        print(f"  {s}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--out-trace", type=Path, default=None)
    ap.add_argument("--skip-fixed", action="store_true", help="skip the 600 s fixed-timeout run (it takes ~10 min)")
    args = ap.parse_args()
    trace = (args.trace.read_text().splitlines() if args.trace else draw_trace(args.seed, args.steps))
    trace = [t for t in trace if t.strip() and not t.startswith("#")]
    if args.out_trace:
        args.out_trace.write_text("\n".join(trace) + "\n")
    print("fault trace:", "; ".join(trace))
    ray.init(log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as d:
            result, wall = run(Path(d), args.steps, plan(trace))
            report("raytrain_ckpt, defaults (hang_timeout_s auto)", result, wall)
            hang = next((f for f in result.failures if f.kind == "hang"), None)
            auto_det = result.goodput["attempts"][hang.attempt]["phases"].get("detection") if hang else None
        if auto_det is not None and not args.skip_fixed:
            hang_only = plan([t for t in trace if t.startswith("hang")]).replace(f"attempt={hang.attempt}", "attempt=0")
            with tempfile.TemporaryDirectory() as d:
                fixed, wall = run(Path(d), args.steps, hang_only, "fault_tolerance.hang_timeout_s=600")
                report("raytrain_ckpt, the hang only, hang_timeout_s 600 (the previous default)", fixed, wall)
                fixed_det = fixed.goodput["attempts"][0]["phases"].get("detection")
            print(f"\nhang detection: auto {auto_det:.1f} s, fixed 600 s {fixed_det:.1f} s: "
                  f"{auto_det / fixed_det:.3f}x")
        elif auto_det is not None:
            print(f"\nhang detection: auto {auto_det:.1f} s; the fixed default was 600 s: {auto_det / 600:.3f}x")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
