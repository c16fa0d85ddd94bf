"""Replica heal benchmark: torchft's healing on Ray actors, CPU and gloo, with the demo's model.

Two replica groups of one rank each train the demo's ~1M-parameter Llama (``model.name: debug``)
with torchft's ``Manager`` (gradients averaged through ``Manager.allreduce``, the step applied on
its commit vote) and ``ProcessGroupGloo``; torchft's
Lighthouse (the quorum) runs in its own Ray actor. Before step ``--kill-step`` replica 1's
process is killed (``ray.kill``, a real SIGKILL of the actor's process) and a new actor takes its
place at once: under the membership rule (``replicas/membership.py``, 5 heal steps here) replica 0
steps alone from the step the failure was seen at, meets the new replica at the rejoin step, and
the new one receives the parameters and optimizer state from replica 0 there, peer to peer.

Printed, per repetition:
* healthy pause: the longest step of replica 0 around the fault, against its median step time;
* heal: kill -> the new replica's first step inside a quorum of two;
* whether both replicas end with the same parameters (a float64 sum over every tensor).

This measures the mechanism a replicated job would use (``docs/ARCHITECTURE.md``, "Replicas heal
from a live peer"); it needs ``pip install -e ".[bench]"`` (or ``".[replicas]"``: torchft).

    .venv/bin/python bench/replica_heal.py [--reps 2] [--steps 150] [--kill-step 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from raytrain_ckpt.replicas.lighthouse import start_lighthouse


@ray.remote(num_cpus=0.5, max_concurrency=2)
class Replica:
    """One replica group of one rank: the demo's model under torchft's Manager."""

    def __init__(self, replica: int, lighthouse: str, roster: str, replacement: bool = False,
                 heal_steps: int = 5) -> None:
        self.replica, self.lighthouse, self.roster = replica, lighthouse, roster
        self.replacement, self.heal_steps = replacement, heal_steps
        self.steps = 1 << 62
        """The step to stop at (``finish_at``): until then a replica trains on, whatever its peers do."""
        self.log: list[tuple[int, float, int]] = []  # (step, time.time() after it, participants)
        self.error: str | None = None
        self.thread = threading.Thread(target=self._train, daemon=True)
        self.thread.start()

    def _train(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - reported to the driver
            import traceback

            self.error = f"replica {self.replica}: {exc!r}\n{traceback.format_exc()}"

    def _loop(self) -> None:
        import torch
        from torch.distributed import TCPStore

        from raytrain_ckpt.models import build_model
        from raytrain_ckpt.replicas.membership import Membership
        from raytrain_ckpt.replicas.sync import ReplicaSync

        torch.manual_seed(0)
        torch.set_num_threads(1)
        model = build_model("debug")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def load(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            sync.healed(state["membership"], state["step"] + 1)

        membership = Membership(2, self.heal_steps)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        sync = ReplicaSync(replica=self.replica, rank=0, ranks=1, lighthouse=self.lighthouse,
                           store=("127.0.0.1", store.port), load=load, membership=membership, roster=self.roster,
                           replacement=self.replacement, timeout_s=10,
                           state=lambda: {"model": model.state_dict(), "optim": opt.state_dict(),
                                          "membership": membership.state(), "step": sync.step})
        vocab = model.cfg.vocab_size
        while sync.step < self.steps:
            step = sync.step + 1
            gen = torch.Generator().manual_seed(1000 * step + self.replica)  # each step's data: a function of the step
            tokens = torch.randint(0, vocab, (4, 65), generator=gen)
            sync.begin(step)
            opt.zero_grad()
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            sync.average([p.grad for p in model.parameters() if p.grad is not None])
            if sync.commit(step):
                opt.step()
            self.log.append((sync.step, time.time(), sync.participants()))
        self.sum = float(sum(p.detach().double().sum() for p in model.parameters()))
        sync.close()

    def progress(self) -> tuple[list[tuple[int, float, int]], str | None, bool]:
        return list(self.log), self.error, not self.thread.is_alive()

    def fingerprint(self) -> float:
        return self.sum

    def finish_at(self, step: int) -> None:
        """Stop once the replicas' step count reaches ``step`` (every replica is told the same one,
        after the heal, so that they end together in one quorum)."""
        self.steps = step

    def pid(self) -> int:
        return os.getpid()


def _wait(actor: Any, until: Any, timeout: float = 300.0) -> list[tuple[int, float, int]]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        log, error, done = ray.get(actor.progress.remote())
        if error is not None:
            raise RuntimeError(error)
        if until(log, done):
            return log
        time.sleep(0.02)
    raise TimeoutError("replica did not get there in time")


@dataclass
class HealRun:
    """One run: each replica's log of (step, time.time() after it, replicas in its quorum)."""

    healthy: list[tuple[int, float, int]]
    failed: list[tuple[int, float, int]]
    """The killed replica's log, as last read before the kill."""
    healer: list[tuple[int, float, int]]
    killed_pid: int
    killed_at: float
    sums: tuple[float, float]
    """The healthy and the healed replica's parameters at the end (float64 sums)."""

    def row(self) -> dict[str, float | bool]:
        healed = next(t for _, t, p in self.healer if p == 2)
        gaps = [b[1] - a[1] for a, b in zip(self.healthy, self.healthy[1:])]
        around = [b[1] - a[1] for a, b in zip(self.healthy, self.healthy[1:])
                  if self.killed_at - 1 <= b[1] <= healed + 5]
        return {"median_step_s": statistics.median(gaps), "pause_s": max(around or [0.0]),
                "heal_s": healed - self.killed_at, "same": self.sums[0] == self.sums[1]}


def one_run(steps: int, kill_step: int, heartbeat_ms: int) -> HealRun:
    """Two replicas; the second's process is killed once it passed ``kill_step`` and replaced by a
    new one; once that one steps in a quorum of two, both stop at ``steps`` (or 10 steps on)."""
    name = f"replica-heal-{time.time_ns()}"
    lighthouse, address = start_lighthouse(name, heartbeat_ms=heartbeat_ms)
    healthy, failing = Replica.remote(0, address, name), Replica.remote(1, address, name)
    actors = [healthy, failing, lighthouse]
    try:
        failed_log = _wait(failing, lambda log, done: bool(log) and log[-1][0] >= kill_step)
        pid = ray.get(failing.pid.remote())
        ray.kill(failing, no_restart=True)
        killed = time.time()
        healer = Replica.remote(1, address, name, replacement=True)
        actors.append(healer)
        joined = _wait(healer, lambda log, done: any(p == 2 for _, _, p in log))
        last = max(joined[-1][0], ray.get(healthy.progress.remote())[0][-1][0])
        for replica in (healthy, healer):
            replica.finish_at.remote(max(steps, last + 10))
        log0 = _wait(healthy, lambda log, done: done)
        log1 = _wait(healer, lambda log, done: done)
        sums = (ray.get(healthy.fingerprint.remote()), ray.get(healer.fingerprint.remote()))
        return HealRun(log0, failed_log, log1, pid, killed, sums)
    finally:
        for actor in actors:
            ray.kill(actor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--heartbeat-ms", type=int, nargs="+", default=[5000, 2000, 500],
                        help="the Lighthouse's heartbeat timeouts to compare (torchft's default is 5000)")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print("replica heal on Ray actors (torchft, gloo, demo model, 2 replica groups x 1 rank)")
    for heartbeat_ms, rep in ((h, r) for h in args.heartbeat_ms for r in range(args.reps)):
        row = one_run(args.steps, args.kill_step, heartbeat_ms).row()
        print(f"  heartbeat timeout {heartbeat_ms} ms, run {rep + 1}: median step {row['median_step_s']:.3f}s, healthy replica's longest step around "
              f"the fault {row['pause_s']:.2f}s ({row['pause_s'] / row['median_step_s']:.1f} step times), "
              f"kill -> healed replica stepping in a quorum of 2 {row['heal_s']:.2f}s, "
              f"parameters identical at the end: {row['same']}")
    ray.shutdown()


if __name__ == "__main__":
    main()
