"""Evidence of a hang, taken before anything is killed: every rank's Python stacks and step.

Stacks are read from outside each rank's process with py-spy (``py-spy dump --pid``, every
thread): it works on a rank that holds the GIL inside a stuck C call (a gloo or NCCL collective),
where nothing inside the process could answer. A rank on the driver's node is dumped by a
subprocess here; one on another node by a zero-CPU Ray task pinned to that node. The dumps go to
``<job root>/diagnostics/attempt-<N>/rank-<R>.stacks.txt`` with ``verdict.txt`` (the culprit and
why), listed in the end report and by ``raytrain-ckpt diagnostics``. At the same time every rank is
asked (from its second actor thread, ``TRACE_TIMEOUT_S``) for its NCCL flight recorder, kept as
``rank-<R>.nccl_trace.pkl`` (``rank/nccl_trace.py``; a gloo rank has none, which ``verdict.txt`` says).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ckpt.common.events import RankPlace
from raytrain_ckpt.control.watch.hangs import DUMP_TIMEOUT_S, Blame, blame, dump_stacks
from raytrain_ckpt.rank.nccl_trace import keep_traces

logger = logging.getLogger(__name__)

__all__ = ["diagnose", "diagnostics_root", "locate"]

PROBE_TIMEOUT_S = 5.0
TRACE_TIMEOUT_S = 10.0
"""How long every rank together has to hand over its NCCL flight recorder."""


@ray.remote(num_cpus=0)
def _dump_on_node(pid: int) -> str:
    return dump_stacks(pid)


def locate(workers: list[Any], timeout_s: float) -> list[RankPlace | None]:
    """Each rank's pid and node id, asked while the ranks answer (at the start of an attempt)."""
    refs = [w.where.remote() for w in workers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out: list[RankPlace | None] = []
    for ref in refs:
        try:
            out.append(ray.get(ref) if ref in ready else None)
        except Exception:  # noqa: BLE001 - a rank that cannot say: its stacks are not read
            out.append(None)
    return out


def _stacks_of(where: RankPlace | None, here: str) -> str:
    if where is None:
        return "(no stacks: the rank's process was never located)"
    pid, node = where.pid, where.node_id
    if node == here:
        return dump_stacks(pid)
    ref = _dump_on_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid)
    try:
        return ray.get(ref, timeout=DUMP_TIMEOUT_S + 10)
    except Exception as exc:  # noqa: BLE001 - a node that does not answer: said in the file
        return f"(no stacks: the dump on node {node} failed: {type(exc).__name__}: {exc})"


def _steps(workers: list[Any]) -> dict[int, int]:
    refs = {w.progress.remote(): rank for rank, w in enumerate(workers)}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    steps = {}
    for ref in ready:
        try:
            steps[refs[ref]] = ray.get(ref).step
        except Exception:  # noqa: BLE001 - a dead rank does not answer
            pass
    return steps


def _traces(workers: list[Any]) -> dict[int, bytes | str]:
    refs = {w.nccl_trace.remote(): rank for rank, w in enumerate(workers)}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=TRACE_TIMEOUT_S)
    answers: dict[int, bytes | str] = {refs[r]: f"did not answer within {TRACE_TIMEOUT_S:g}s" for r in refs}
    for ref in ready:
        try:
            answers[refs[ref]] = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a dead rank has no dump: said in the verdict
            answers[refs[ref]] = f"the call failed: {type(exc).__name__}"
    return answers


def diagnose(workers: list[Any], where: list[RankPlace | None], folder: Path) -> Blame:
    """Read every rank's stacks and step (concurrently), keep the stacks in ``folder``, and blame."""
    here = ray.get_runtime_context().get_node_id()
    with ThreadPoolExecutor(max_workers=len(workers) + 2) as pool:
        probe = pool.submit(_steps, workers)
        recorded = pool.submit(_traces, workers)
        dumps = [pool.submit(_stacks_of, where[r] if r < len(where) else None, here) for r in range(len(workers))]
        stacks = {r: d.result() for r, d in enumerate(dumps)}
        steps = probe.result()
        traces = recorded.result()
    read = {r: text for r, text in stacks.items() if not text.startswith("(no stacks")}
    verdict = blame(len(workers), steps, read)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for rank, text in stacks.items():
            (folder / f"rank-{rank}.stacks.txt").write_text(text)
        lines = [f"culprit: {'rank ' + ', '.join(map(str, verdict.ranks)) if verdict.ranks else 'none'}",
                 f"reason: {verdict.reason}",
                 *(f"rank {r}: step {steps[r]}" if r in steps else f"rank {r}: did not answer"
                   for r in range(len(workers))),
                 *keep_traces(folder, traces, len(workers))]
        (folder / "verdict.txt").write_text("\n".join(lines) + "\n")
    except OSError as exc:
        logger.warning("could not keep the hang's stacks in %s: %s", folder, exc)
        return Blame(verdict.ranks, verdict.reason, verdict.frames, None)
    return Blame(verdict.ranks, verdict.reason, verdict.frames, str(folder))


def diagnostics_root(spec: Any) -> Path:
    """Where a job's diagnostics go: under its job root on a file system, else under the local
    results base (an object-store job's stacks stay on the driver's machine)."""
    from raytrain_ckpt.common.locations import is_uri

    base = spec.checkpoint.dir
    if is_uri(str(base)):
        from raytrain_ckpt.spec.sections import results_dir

        base = results_dir()
        base = base if not is_uri(str(base)) else Path.home() / "raytrain_results"
    return Path(os.fspath(base)) / spec.name / "diagnostics"
