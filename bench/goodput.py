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

Then Ray Train's ``TorchTrainer`` runs the same ``Trainer`` (``bench/raytrain_peer.py``) with the
same interval (``dcp.save`` + ``ray.train.report(checkpoint=...)`` every 5 steps), its defaults
(``TorchConfig.timeout_s`` 1800, the process group's timeout, is its hang detection on CPU) and
``FailureConfig(max_failures=5)``, under the same trace injected the same way
(``faults.maybe_inject`` at point ``step``, the attempt counted by each worker). The hang is left
out of its trace unless ``--ray-train-hang`` (it costs the 30-minute timeout); the attempts after
it move up by one. Its goodput is the non-redone step time (rank 0's step ends, a save excluded)
over ``fit()``'s wall time; lost time is the time after the first step that is neither that nor a
save, per restart.

The replicated row runs the same job as two replica groups of one worker (``dp_replicate: 2``,
``heal_steps: 5``) with the trace's crashes and hangs moved onto the second group's rank in the first
attempt (each is then healed inside the attempt; the slow rank is left out), and once without faults:
its lost seconds per fault are the wall time the faults added, over the heals.

The torchft row (``--runs ray-train-torchft``, about a minute, in the default set) runs the same
replicated job under Ray Train's own torchft integration: ``TorchTrainer`` with ``TorchftConfig``
(gloo; its Lighthouse with our Lighthouse's heartbeat, join and tick settings, ``min_replicas`` 1)
and ``FailureConfig(max_failures=5)``, 2 workers each a replica group of one rank, the same
``Trainer`` (``bench/raytrain_peer.py``) stepping through a torchft ``Manager`` as torchft's
optimizer and DDP wrappers do (quorum, gradient all-reduce, commit vote) with a ``PGTransport``
heal, as Ray Train's torchft example does. Ray Train replaces a crashed worker alone; torchft heals
it from the live one. Its trace is the replicated row's crashes on rank 1, the n-th in that rank's
n-th start (``torchft_trace``); the hang is left out, not run (a hung worker's actor lives and its
Manager keeps heartbeating, so Ray Train does not replace it and the healthy worker's quorums wait
on it). Once without faults and once with them: the wall time, the healthy replica's longest pause
between steps, per replacement the seconds from the fault to its start and to its first step in a
quorum (not observed when the steps were done first), lost seconds per fault (the wall time added,
over the replacements), and our replicated row's lost per fault over this row's.

    PYTHONPATH=$PWD .venv/bin/python bench/goodput.py [--steps 40] [--seed 0] [--trace FILE] [--skip-fixed]
        [--runs ours replicated ray-train-torchft ray-train] [--ray-train-hang]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import ray
import raytrain_peer

from raytrain_ckpt.common.faults import ENV_VAR, STAMP_VAR

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "jobs" / "llama_debug_fsdp.yaml"
KINDS = {"crash": "exit", "hang": "hang", "slow": "slow"}
REPLICAS = ("parallelism.dp_replicate=2", "parallelism.dp_shard=1")
"""Two replica groups of one worker: the replicated row and the Ray Train torchft row."""


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
    from raytrain_ckpt.control.driver import run_job
    from raytrain_ckpt.control.preflight import load_spec

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


def without_hangs(trace: list[str]) -> list[str]:
    """The trace less its hangs, each later fault's attempt moved up by the hangs before it."""
    out, dropped = [], 0
    for line in trace:
        kind, *args = line.split()
        if kind == "hang":
            dropped += 1
            continue
        out.append(" ".join([kind, *(f"attempt={int(a.split('=')[1]) - dropped}" if a.startswith("attempt=") else a
                                     for a in args)]))
    return out


def _next_attempt(tmp: Path, rank: int) -> int:
    """This worker's attempt: the number of times this rank started before (Ray Train does not say)."""
    path = tmp / f"rt-starts-{rank}"
    attempt = int(path.read_text()) if path.exists() else 0
    path.write_text(str(attempt + 1))
    return attempt


def _ray_train_loop(config: dict) -> None:
    from raytrain_ckpt.common import faults

    trainer, rank, _ = raytrain_peer.start(config)
    tmp, steps = Path(config["tmp"]), trainer.spec.training.steps
    attempt = _next_attempt(tmp, rank)
    os.environ[faults.ENV_VAR] = config["faults"]
    with (tmp / f"rt-log-{rank}").open("a") as log:
        while trainer.state.step < steps:
            faults.maybe_inject("step", rank, trainer.state.step, attempt)
            trainer.train_step()
            stepped = time.time()
            if trainer.state.step % 5 == 0:
                raytrain_peer.save(trainer, tmp, rank, {"step": trainer.state.step})
            log.write(f"{attempt} {trainer.state.step} {stepped!r} {time.time()!r}\n")
            log.flush()


def ray_train_ledger(rows: list[tuple[int, int, float, float]], started: float, ended: float) -> dict:
    """Rank 0's ``(attempt, step, step end, save end)`` rows, and ``fit()``'s start and end (all
    ``time.time()``), as goodput: a step's time runs from the previous row's save end (the first
    step of an attempt is not counted), redone when an earlier attempt had finished that step;
    lost is everything else between the first step's end and the last's."""
    sec = {"training": 0.0, "redone": 0.0, "checkpoint": 0.0}
    high, prev, prev_end = 0, None, None
    for attempt, step, stepped, saved in sorted(rows):
        if attempt != prev:
            high = max([high] + [s for a, s, _, _ in rows if a == prev])
            prev, prev_end = attempt, None
        if prev_end is not None:
            sec["redone" if step <= high else "training"] += stepped - prev_end
        sec["checkpoint"] += saved - stepped
        prev_end = saved
    first, last = min(r[3] for r in rows if r[0] == 0), max(r[3] for r in rows)
    restarts = len({r[0] for r in rows}) - 1
    lost = last - first - sec["training"] - sec["checkpoint"]
    sec["restarts"] = lost - sec["redone"]
    sec["start, first step"], sec["end"] = first - started, ended - last
    wall = ended - started
    return {"goodput": sec["training"] / wall, "wall_s": wall, "seconds": sec, "restarts": restarts,
            "lost_s": lost, "lost_per_fault_s": lost / restarts if restarts else 0.0}


def run_ray_train(tmp: Path, steps: int, trace: list[str]) -> dict:
    from ray.train import FailureConfig

    from raytrain_ckpt.control.preflight import load_spec

    spec = load_spec(SPEC, [f"training.steps={steps}", f"checkpoint.dir={tmp / 'unused'}",
                            "checkpoint.interval_steps=5", "training.log_every_steps=100"])
    config = {"spec": spec.model_dump_json(), "tmp": str(tmp), "faults": plan(trace)}
    trainer = raytrain_peer.torch_trainer(_ray_train_loop, config, tmp, "goodput", FailureConfig(max_failures=5))
    started = time.time()
    result = trainer.fit()
    ended = time.time()
    assert result.error is None, result.error
    rows = [(int(a), int(s), float(t), float(e)) for a, s, t, e in
            (line.split() for line in (tmp / "rt-log-0").read_text().splitlines())]
    return ray_train_ledger(rows, started, ended)


def report_ray_train(led: dict, trace: list[str], ours_per_fault: float | None,
                     replicated_per_fault: float | None = None) -> None:
    print(f"\n== Ray Train TorchTrainer, trace {'; '.join(trace)}: {led['restarts']} restart(s), "
          f"{led['wall_s']:.1f} s wall, goodput {100 * led['goodput']:.1f}%")
    for cause, s in sorted(led["seconds"].items(), key=lambda kv: -kv[1]):
        print(f"  {cause:<17} {s:7.1f} s  {100 * s / led['wall_s']:5.1f}%")
    print(f"  lost to {led['restarts']} fault(s): {led['lost_s']:.1f} s (redone, and the restarts: "
          f"detection, teardown, start, load, first step), {led['lost_per_fault_s']:.1f} s per fault")
    if ours_per_fault is not None and led["lost_per_fault_s"] > 0:
        print(f"lost per fault, raytrain_ckpt / Ray Train: {ours_per_fault / led['lost_per_fault_s']:.2f}x")
    if replicated_per_fault is not None and led["lost_per_fault_s"] > 0:
        print(f"lost per fault, raytrain_ckpt with replica groups / Ray Train: "
              f"{replicated_per_fault / led['lost_per_fault_s']:.2f}x")


def report(name: str, result, wall: float) -> float | None:
    """Print the ledger of a run; returns its lost seconds per fault (None without faults)."""
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
    return lost / len(result.failures) if result.failures else None


def run_ours(args: argparse.Namespace, trace: list[str]) -> float | None:
    """raytrain_ckpt under the trace (and the hang alone at the fixed 600 s); its lost seconds per fault."""
    with tempfile.TemporaryDirectory() as d:
        result, wall = run(Path(d), args.steps, plan(trace))
        per_fault = report("raytrain_ckpt, defaults (hang_timeout_s auto)", result, wall)
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
    return per_fault


def replica_trace(trace: list[str]) -> list[str]:
    """The trace's crashes and hangs on the second replica group's rank (1) of attempt 0, in order:
    with replica groups each is healed inside the attempt (the first group, which saves, would
    restart the whole job, as without replicas). A ``slow`` line is left out."""
    return [" ".join([kind, "rank=1", *(a for a in args if a.startswith("step=")), "attempt=0"])
            for kind, *args in (line.split() for line in trace) if kind != "slow"]


def run_replicated(args: argparse.Namespace, trace: list[str]) -> float | None:
    """The same job as two replica groups of one worker (``parallelism.dp_replicate: 2``,
    ``heal_steps: 5``), without faults and under ``replica_trace``: the lost seconds per fault are
    the wall time the faults added, over the heals that happened."""
    walls = []
    for faults in ([], replica_trace(trace)):
        with tempfile.TemporaryDirectory() as d:
            result, wall = run(Path(d), args.steps, plan(faults), *REPLICAS, "fault_tolerance.heal_steps=5")
        walls.append(wall)
        skipped = result.results[0].replicas["skipped"] if result.results and result.results[0].replicas else []
        print(f"\n== replica groups (2 x 1 worker), {'fault trace: ' + '; '.join(faults) if faults else 'no faults'}: "
              f"{result.state.value}, {result.attempts} attempt(s), {wall:.1f} s wall, {len(result.heals)} heal(s), "
              f"{len(skipped)} group-step(s) skipped, redone steps {result.results[0].replicas['redone'] if skipped else 0}")
        for h in result.heals:
            print(f"  heal: replica {h['replica']} after a {h['kind']} on rank {h['rank']}, back in the quorum "
                  f"{h.get('healed_s', float('nan')):.1f} s after its detection (heal_steps 5 included)")
        if result.goodput:
            print(f"  ledger: {result.goodput['seconds'].get('degraded', 0.0):.1f} s trained with fewer replica groups "
                  f"(their share), goodput {100 * result.goodput['goodput']:.1f}%")
    heals = len(result.heals)
    if not heals:
        return None
    per_fault = (walls[1] - walls[0]) / heals
    print(f"  lost to {heals} fault(s): {walls[1] - walls[0]:.1f} s over the fault-free run, {per_fault:.1f} s per fault")
    return per_fault


class RowFailed(RuntimeError):
    """A row that could not run, with why in one line."""


def torchft_trace(trace: list[str]) -> list[str]:
    """The replicated row's crashes (``replica_trace``), the n-th on rank 1's n-th start: Ray Train
    puts a new worker in a crashed one's place, and the attempt is counted per rank. Hangs are left
    out: a hung worker's actor is alive and its torchft Manager heartbeats from its own thread, so
    Ray Train does not replace it and the healthy worker's quorums wait on it."""
    crashes = [line for line in replica_trace(trace) if line.startswith("crash")]
    return [line.replace("attempt=0", f"attempt={n}") for n, line in enumerate(crashes)]


class TorchftReplicas:
    """The ``Trainer``'s replicas hook over a plain torchft ``Manager``, called as torchft's
    ``Optimizer`` and ``DistributedDataParallel`` wrappers call it: the quorum at the step's start,
    the gradients averaged across it, the step applied on the commit vote (a failed one is redone)."""

    def __init__(self, manager, groups: int) -> None:
        self.manager, self.groups, self.last_skipped = manager, groups, 0

    def begin(self, step: int) -> None:
        self.manager.start_quorum()

    def average(self, grads: list) -> None:
        from raytrain_ckpt.replicas.sync import average_flat

        average_flat(self.manager, grads)

    def commit(self, step: int) -> bool:
        ok = self.manager.should_commit()
        if ok:
            self.last_skipped = self.groups - self.manager.num_participants()
        return ok


def _torchft_manager(trainer, rank: int):
    """This worker's torchft ``Manager``, as Ray Train's torchft example builds it (gloo, a
    ``PGTransport`` for the heal, ``min_replica_size`` 1); a replacement receives the trainer's
    local state as the package's heals send it (``rank/replicas.py``; torchft keeps no membership record)."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from raytrain_ckpt.rank.replicas import heal_state, load_heal_state

    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    no_record = SimpleNamespace(state=dict)
    return Manager(pg=pg, min_replica_size=1, load_state_dict=lambda state: load_heal_state(trainer, state),
                   state_dict=lambda: heal_state(trainer, no_record), world_size=1, rank=0,
                   replica_id=f"goodput_{rank}", timeout=timedelta(seconds=60),
                   checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=30), device=torch.device("cpu")))


def _torchft_loop(config: dict) -> None:
    """A worker of the torchft row: ``(attempt, step, time)`` rows to ``tft-log-RANK``, step -1 when
    its Manager is up, then each committed step. The first start waits for both workers' Managers (else
    the first one up trains alone and the other's first quorum times out, as Ray Train's torchft example
    does on a loaded 2-core machine); a worker that starts after the steps are done ends at once (its
    quorum would hold no live peer to heal from, and it would train the job again alone)."""
    from ray.train.collective import barrier

    from raytrain_ckpt.common import faults

    trainer, rank, _ = raytrain_peer.start(config)
    tmp, steps = Path(config["tmp"]), trainer.spec.training.steps
    attempt = _next_attempt(tmp, rank)
    os.environ[faults.ENV_VAR] = config["faults"]
    manager = _torchft_manager(trainer, rank)
    trainer.replicas = TorchftReplicas(manager, trainer.spec.parallelism.dp_replicate)
    if attempt == 0:
        barrier()
    done = tmp / "tft-done"
    with (tmp / f"tft-log-{rank}").open("a") as log:
        log.write(f"{attempt} -1 {time.time()!r}\n")
        log.flush()
        while trainer.state.step < steps and not done.exists():
            faults.maybe_inject("step", rank, trainer.state.step, attempt)
            if trainer.train_step() is not None:
                log.write(f"{attempt} {trainer.state.step} {time.time()!r}\n")
                log.flush()
    if trainer.state.step >= steps:
        done.touch()
    manager.shutdown()


def torchft_ledger(rows: dict[int, list[tuple[int, int, float]]], ended: float) -> dict:
    """The ranks' ``(attempt, step, time)`` rows and ``fit()``'s end (``time.time()``) as the row's
    figures: the healthy replica's (rank 0) longest pause between committed steps, its median step and
    the seconds from its last step to the end, and per replacement of rank 1 the seconds from the fault
    (its predecessor's last row) to its start and to its first committed step (None: it was not in a
    quorum before the steps were done), with that step."""
    steps0 = sorted(t for _, s, t in rows[0] if s > 0)
    gaps = sorted(b - a for a, b in zip(steps0, steps0[1:]))
    by_attempt: dict[int, list[tuple[int, float]]] = {}
    for attempt, step, t in sorted(rows.get(1, []), key=lambda r: r[2]):
        by_attempt.setdefault(attempt, []).append((step, t))
    heals = []
    for attempt in sorted(by_attempt)[1:]:
        fault = by_attempt[attempt - 1][-1][1]
        started = next(t for s, t in by_attempt[attempt] if s < 0)
        first = next(((s, t) for s, t in by_attempt[attempt] if s > 0), None)
        heals.append({"started_s": started - fault, "healed_s": None if first is None else first[1] - fault,
                      "step": None if first is None else first[0]})
    return {"longest_pause_s": gaps[-1] if gaps else 0.0, "median_step_s": gaps[len(gaps) // 2] if gaps else 0.0,
            "tail_s": ended - steps0[-1], "heals": heals}


def run_ray_train_torchft(tmp: Path, steps: int, trace: list[str]) -> dict:
    """One ``fit()`` of the torchft row under ``trace``: its wall time and ``torchft_ledger``."""
    from ray.train import FailureConfig
    from ray.train.v2.torch.torchft_config import TorchftConfig

    from raytrain_ckpt.control.preflight import load_spec
    from raytrain_ckpt.replicas.lighthouse import HEARTBEAT_MS, JOIN_MS, TICK_MS

    spec = load_spec(SPEC, [f"training.steps={steps}", f"checkpoint.dir={tmp / 'unused'}",
                            "training.log_every_steps=100", *REPLICAS])
    config = {"spec": spec.model_dump_json(), "tmp": str(tmp), "faults": plan(trace)}
    lighthouse = {"min_replicas": 1, "heartbeat_timeout_ms": HEARTBEAT_MS, "join_timeout_ms": JOIN_MS,
                  "quorum_tick_ms": TICK_MS}
    trainer = raytrain_peer.torch_trainer(_torchft_loop, config, tmp, "goodput-torchft", FailureConfig(max_failures=5),
                                          TorchftConfig(lighthouse_kwargs=lighthouse, backend="gloo"))
    started = time.time()
    result = trainer.fit()
    ended = time.time()
    if result.error is not None:
        raise RowFailed(f"Ray Train torchft row failed: {str(result.error).strip().splitlines()[0]}")
    rows = {rank: [(int(a), int(s), float(t)) for a, s, t in
                   (line.split() for line in (tmp / f"tft-log-{rank}").read_text().splitlines())] for rank in (0, 1)}
    restarts = len({a for a, _, _ in rows[0]}) - 1
    if restarts:
        raise RowFailed(f"Ray Train torchft row not valid: the healthy worker (rank 0) was restarted {restarts} "
                        "time(s), by an error outside the trace (its Ray worker logs say which)")
    return {"wall_s": ended - started, **torchft_ledger(rows, ended)}


def report_torchft(led: dict, trace: list[str]) -> None:
    print(f"\n== Ray Train TorchTrainer + TorchftConfig (2 workers, a replica group each), "
          f"{'fault trace: ' + '; '.join(trace) if trace else 'no faults'}: {led['wall_s']:.1f} s wall, "
          f"{len(led['heals'])} replacement(s); the healthy replica's longest pause between steps "
          f"{led['longest_pause_s']:.2f} s (median step {led['median_step_s']:.2f} s), its last step -> fit() "
          f"returned {led['tail_s']:.1f} s")
    for n, h in enumerate(led["heals"], 1):
        back = (f"in a quorum at step {h['step']} {h['healed_s']:.1f} s after the fault" if h["healed_s"] is not None
                else "not in a quorum before the steps were done")
        print(f"  replacement {n}: started {h['started_s']:.1f} s after the fault, {back}")


def run_torchft(args: argparse.Namespace, trace: list[str]) -> float | None:
    """Ray Train's torchft integration on the same job, without faults and under ``torchft_trace``:
    lost seconds per fault are the wall time the crashes added, over the replacements."""
    walls, faults = [], torchft_trace(trace)
    for t in ([], faults):
        with tempfile.TemporaryDirectory() as d:
            led = run_ray_train_torchft(Path(d), args.steps, t)
        report_torchft(led, t)
        walls.append(led["wall_s"])
    if not led["heals"]:
        return None
    per_fault = (walls[1] - walls[0]) / len(led["heals"])
    print(f"  lost to {len(led['heals'])} fault(s): {walls[1] - walls[0]:.1f} s over the fault-free run, "
          f"{per_fault:.1f} s per fault")
    return per_fault


def torchft_problem() -> str | None:
    """Why the torchft row cannot run here (one line), or None."""
    try:
        from ray.train.v2.torch.torchft_config import TorchftConfig  # noqa: F401
        import torchft  # noqa: F401
    except ImportError as exc:
        return f"Ray Train torchft row not run: {exc}"
    return None


def compare_torchft(args: argparse.Namespace, trace: list[str], replicated: float | None) -> None:
    """The torchft row, and our replicated row's lost seconds per fault over its."""
    problem = torchft_problem()
    if problem is not None:
        print(problem)
        return
    try:
        per_fault = run_torchft(args, trace)
    except RowFailed as exc:
        print(exc)
        return
    if replicated is None or per_fault is None:
        return
    if replicated <= 0 or per_fault <= 0:
        print("lost per fault, raytrain_ckpt with replica groups / Ray Train with TorchftConfig: not compared, a "
              "faulted run was not slower than its fault-free run (the difference is below this machine's noise)")
        return
    print(f"lost per fault, raytrain_ckpt with replica groups / Ray Train with TorchftConfig: "
          f"{replicated / per_fault:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--out-trace", type=Path, default=None)
    ap.add_argument("--skip-fixed", action="store_true", help="skip the 600 s fixed-timeout run (it takes ~10 min)")
    ap.add_argument("--runs", nargs="+", choices=("ours", "replicated", "ray-train-torchft", "ray-train"),
                    default=["ours", "replicated", "ray-train-torchft", "ray-train"])
    ap.add_argument("--ray-train-hang", action="store_true",
                    help="keep the hang in Ray Train's trace (its detection by default takes 30 minutes)")
    args = ap.parse_args()
    trace = (args.trace.read_text().splitlines() if args.trace else draw_trace(args.seed, args.steps))
    trace = [t for t in trace if t.strip() and not t.startswith("#")]
    if args.out_trace:
        args.out_trace.write_text("\n".join(trace) + "\n")
    print("fault trace:", "; ".join(trace))
    ray.init(log_to_driver=False)
    try:
        per_fault = run_ours(args, trace) if "ours" in args.runs else None
        replicated = run_replicated(args, trace) if "replicated" in args.runs else None
        if "ray-train-torchft" in args.runs:
            compare_torchft(args, trace, replicated)
        if "ray-train" in args.runs and raytrain_peer.available():
            rt_trace = trace if args.ray_train_hang else without_hangs(trace)
            with tempfile.TemporaryDirectory() as d:
                report_ray_train(run_ray_train(Path(d), args.steps, rt_trace), rt_trace, per_fault, replicated)
            if not args.ray_train_hang and len(rt_trace) < len(trace):
                print("Ray Train's hang detection, not run: TorchConfig.timeout_s = 1800 s by default "
                      "(the gloo process group's timeout), 3x the 600 s fixed timeout")
        elif "ray-train" in args.runs:
            print('Ray Train not installed (pip install -e ".[bench]"): not compared')
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
