"""Replica heal benchmark: torchft's healing on Ray actors, CPU and gloo, with the demo's model.

Two replica groups of one rank each train the demo's ~1M-parameter Llama (``model.name: debug``)
with torchft's ``Manager`` (gradients averaged through ``Manager.allreduce``, the step applied on
its commit vote) and ``ProcessGroupGloo``; torchft's
Lighthouse (the quorum) runs in its own Ray actor. Before step ``--kill-step`` replica 1's
process is killed (``ray.kill``, a real SIGKILL of the actor's process) and a new actor takes its
place at once: it joins the next quorum and receives the parameters and optimizer state from
replica 0, peer to peer, while replica 0 keeps stepping.

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
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

import ray


@ray.remote(num_cpus=0)
class Lighthouse:
    """torchft's quorum server, in a process of its own. ``heartbeat_ms``: how long a replica's
    silence takes to drop it from the next quorum (what a healthy replica waits after a peer died)."""

    def __init__(self, heartbeat_ms: int) -> None:
        from torchft._torchft import LighthouseServer

        self.server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100,
                                       heartbeat_timeout_ms=heartbeat_ms, quorum_tick_ms=50)

    def address(self) -> str:
        return self.server.address()


@ray.remote(num_cpus=0.5, max_concurrency=2)
class Replica:
    """One replica group of one rank: the demo's model under torchft's Manager."""

    def __init__(self, replica: int, lighthouse: str, steps: int) -> None:
        self.replica, self.lighthouse, self.steps = replica, lighthouse, steps
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
        from torchft import Manager, Optimizer, ProcessGroupGloo

        from raytrain_ckpt.models import build_model

        torch.manual_seed(0)
        torch.set_num_threads(1)
        model = build_model("debug")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def load(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                          load_state_dict=load, state_dict=lambda: {"model": model.state_dict(),
                                                                    "optim": opt.state_dict()},
                          replica_id=f"replica{self.replica}", store_addr="127.0.0.1", store_port=store.port,
                          rank=0, world_size=1, lighthouse_addr=self.lighthouse,
                          timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60))
        optimizer = Optimizer(manager, opt)  # its step() starts the quorum and applies only on a commit vote
        vocab = model.cfg.vocab_size if hasattr(model, "cfg") else 256
        gen = torch.Generator().manual_seed(1000 + self.replica)
        while manager.current_step() < self.steps:
            tokens = torch.randint(0, vocab, (4, 65), generator=gen)
            optimizer.zero_grad()
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            # the replicate dimension's gradient average: one flat buffer through the Manager (a
            # failed peer makes it an error the commit vote sees, not an exception here)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            manager.allreduce(flat).wait()
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            optimizer.step()
            self.log.append((manager.current_step(), time.time(), manager.num_participants()))
        self.sum = float(sum(p.detach().double().sum() for p in model.parameters()))
        manager.shutdown(wait=False)

    def progress(self) -> tuple[list[tuple[int, float, int]], str | None, bool]:
        return list(self.log), self.error, not self.thread.is_alive()

    def fingerprint(self) -> float:
        return self.sum


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


def one_run(steps: int, kill_step: int, heartbeat_ms: int) -> dict[str, float | bool]:
    lighthouse = Lighthouse.remote(heartbeat_ms)
    address = ray.get(lighthouse.address.remote())
    healthy, failing = Replica.remote(0, address, steps), Replica.remote(1, address, steps)
    _wait(failing, lambda log, done: bool(log) and log[-1][0] >= kill_step)
    ray.kill(failing, no_restart=True)
    killed = time.time()
    healer = Replica.remote(1, address, steps)
    healed_log = _wait(healer, lambda log, done: any(p == 2 for _, _, p in log))
    healed = next(t for _, t, p in healed_log if p == 2)
    log0 = _wait(healthy, lambda log, done: done)
    _wait(healer, lambda log, done: done)
    gaps = [b[1] - a[1] for a, b in zip(log0, log0[1:])]
    around = [b[1] - a[1] for a, b in zip(log0, log0[1:]) if killed - 1 <= b[1] <= healed + 5]
    same = ray.get(healthy.fingerprint.remote()) == ray.get(healer.fingerprint.remote())
    for actor in (healthy, healer, lighthouse):
        ray.kill(actor)
    return {"median_step_s": statistics.median(gaps), "pause_s": max(around or [0.0]),
            "heal_s": healed - killed, "same": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--heartbeat-ms", type=int, nargs="+", default=[5000, 500],
                        help="the Lighthouse's heartbeat timeouts to compare (torchft's default is 5000)")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print("replica heal on Ray actors (torchft, gloo, demo model, 2 replica groups x 1 rank)")
    for heartbeat_ms, rep in ((h, r) for h in args.heartbeat_ms for r in range(args.reps)):
        row = one_run(args.steps, args.kill_step, heartbeat_ms)
        print(f"  heartbeat timeout {heartbeat_ms} ms, run {rep + 1}: median step {row['median_step_s']:.3f}s, healthy replica's longest step around "
              f"the fault {row['pause_s']:.2f}s ({row['pause_s'] / row['median_step_s']:.1f} step times), "
              f"kill -> healed replica stepping in a quorum of 2 {row['heal_s']:.2f}s, "
              f"parameters identical at the end: {row['same']}")
    ray.shutdown()


if __name__ == "__main__":
    main()
