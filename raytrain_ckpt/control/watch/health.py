"""A short health probe of a node before it gets a rank again after one of its ranks failed.

It checks that a process there answers (within ``PROBE_TIMEOUT_S``), that the staging file system
(``/dev/shm``) has room for the ranks' staging buffers, and that the checkpoint root (a local one)
can be written (``checkpoint/datapath/buffers.node_problem``). A zero-CPU Ray task pinned to the
node runs the checks, so a process there also has to start; but on a CPU job's node that still
holds a kept rank (its process left the failed step and reset), that process runs them
(``TrainWorker.node_problem``). A new Ray worker only for the probe cost 0.3-0.7 s on every
restart after a crash, on the restart's path, while the kept process already shows that the
node runs ours; a rank there that does need a new process gets one or fails the start
(``fault_tolerance.start_timeout_s``). A kept process that cannot answer (it died after its reset)
is no verdict on its node: the task probes that node instead. A node that fails the probe is
quarantined at once (``control/watch/quarantine.py``) and the attempt's start fails, so the next
one is placed around it.

On a GPU job (``resources.gpus > 0``) the probe is always the task, and it also runs a
``GPU_CHECK_N`` square matmul of ones on each device it sees and synchronizes (the result must
be ``GPU_CHECK_N`` everywhere), within ``GPU_CHECK_TIMEOUT_S``. It gets its device the way a
rank does: it runs in a free bundle of the job's own placement group on that node
(``plan_probes``), asking that bundle's GPUs. The probe runs
after the bundles are reserved and before the ranks are created, so a free bundle's GPUs wait for
it; a task asking GPUs outside the group would wait behind the group's own reservation on a full
node, and a zero-GPU task sees no device (Ray hides them). When every bundle on the node holds a
kept rank, the GPU is not checked (logged). A probe that does not answer in time is cancelled
(its process killed), so it never keeps the bundle's GPU from the rank. No collective is probed:
a one-process NCCL group only shows the library loads, not the links between nodes that fail,
and the rendezvous and the collectives' timeout already bound those.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from raytrain_ckpt.checkpoint.datapath.buffers import MIN_SHM_FREE, node_problem, shm_dir

logger = logging.getLogger(__name__)

__all__ = ["MIN_SHM_FREE", "ProbePlan", "gpu_problem", "node_problem", "plan_probes", "probe_nodes"]

PROBE_TIMEOUT_S = 20.0
GPU_CHECK_TIMEOUT_S = 10.0
"""How long the matmul and synchronize on every device may take (CUDA's start included)."""
GPU_CHECK_N = 256
"""The side of the square matrices of ones multiplied on each device."""


@dataclass(frozen=True)
class ProbePlan:
    """Where one node's probe runs and what it checks."""

    node: str
    bundle: int | None
    """The free bundle of the job's placement group on the node the probe runs in (it gets that
    bundle's GPUs); None: pinned to the node outside the group, with no GPU."""
    gpus: float = 0.0
    """One rank's ``resources.gpus``: what the probe asks of its bundle; 0: a CPU job."""

    @property
    def checks_gpu(self) -> bool:
        return self.bundle is not None and self.gpus > 0


def plan_probes(nodes: list[str], bundle_nodes: list[str], busy: set[int], gpus: float) -> list[ProbePlan]:
    """One probe per node of ``nodes``: in the node's first bundle (index into ``bundle_nodes``)
    that no kept rank holds (``busy``) when the job uses GPUs, else outside the group."""
    plans = []
    for node in dict.fromkeys(nodes):
        free = [i for i, n in enumerate(bundle_nodes) if n == node and i not in busy] if gpus > 0 else []
        plans.append(ProbePlan(node, free[0] if free else None, gpus))
    return plans


def gpu_problem(timeout_s: float = GPU_CHECK_TIMEOUT_S, n: int = GPU_CHECK_N) -> str | None:
    """What is wrong with this process's CUDA devices (None: healthy): none visible, an error, a
    wrong product of ``n`` x ``n`` ones, or a matmul and synchronize not done within ``timeout_s``."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
    found: list[str] = []

    def check() -> None:
        try:
            for d in range(torch.cuda.device_count()):
                ones = torch.ones(n, n, device=torch.device("cuda", d))
                product = ones @ ones
                torch.cuda.synchronize(d)
                if not bool((product == n).all()):
                    found.append(f"a {n}x{n} matmul of ones on cuda:{d} gave {product.min().item():g}..."
                                 f"{product.max().item():g}, not {n}")
        except Exception as exc:  # noqa: BLE001 - the device's error is the answer
            found.append(f"the GPU check failed: {type(exc).__name__}: {exc}")
        found.append("")  # done

    # A daemon thread: a device that never finishes the kernel leaves the thread stuck, not the answer.
    thread = threading.Thread(target=check, name="gpu-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not found or found[-1] != "":
        return f"a {n}x{n} matmul and synchronize on its GPU(s) did not finish within {timeout_s:g}s"
    return found[0] or None


def _check_node(root: str | None, gpu: bool) -> str | None:
    return node_problem(shm_dir(), root) or (gpu_problem() if gpu else None)


@ray.remote(num_cpus=0)
def _probe(root: str | None) -> str | None:
    return _check_node(root, False)


# max_calls=1 (which .options() cannot set, hence two functions): the process exits after the
# probe, with a GPU check's thread that may be stuck and the CUDA context it made.
@ray.remote(num_cpus=0, max_calls=1)
def _probe_gpu(root: str | None) -> str | None:
    return _check_node(root, True)


def _submit(plan: ProbePlan, root: str | None, pg: Any, kept: Any = None) -> ray.ObjectRef:
    if kept is not None and plan.gpus == 0:
        return kept.node_problem.remote(root)
    if not plan.checks_gpu or pg is None:
        strategy = NodeAffinitySchedulingStrategy(plan.node, soft=False)
        return _probe.options(scheduling_strategy=strategy).remote(root)
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=plan.bundle)
    return _probe_gpu.options(num_gpus=plan.gpus, scheduling_strategy=strategy).remote(root)


def probe_nodes(plans: list[ProbePlan], root: str | None, pg: Any = None,
                kept: dict[str, Any] | None = None) -> dict[str, str]:
    """Probe each node (concurrently) as ``plans`` say (GPU checks run in ``pg``'s bundles);
    returns node id -> problem for those that failed. ``kept``: by node, a kept rank's process
    there, which runs a CPU node's checks instead of a new task (see the module docstring)."""
    kept = kept or {}
    asked: dict[ray.ObjectRef, tuple[ProbePlan, bool]] = {}
    for plan in plans:
        if plan.gpus > 0 and not plan.checks_gpu:
            logger.info("node %s: its GPU is not checked (every bundle there holds a kept rank)", plan.node[:12])
        by_kept = plan.gpus == 0 and plan.node in kept
        asked[_submit(plan, root, pg, kept.get(plan.node) if by_kept else None)] = (plan, by_kept)
    problems, unable = _answers(asked)
    if unable:  # a kept process that died after its reset says nothing of its node: a new process probes it
        logger.info("node(s) %s: the kept process could not run the health probe; a new one does",
                    ", ".join(p.node[:12] for p in unable))
        problems |= _answers({_submit(p, root, pg): (p, False) for p in unable})[0]
    return problems


def _answers(asked: dict[ray.ObjectRef, tuple[ProbePlan, bool]]) -> tuple[dict[str, str], list[ProbePlan]]:
    """The problems of the probes ``asked`` (ref -> plan, whether a kept process runs it), and the
    plans whose kept process raised instead of answering."""
    ready, late = ray.wait(list(asked), num_returns=len(asked), timeout=PROBE_TIMEOUT_S)
    for ref in late:  # a stuck probe must not keep its bundle's GPU from the rank
        if not asked[ref][1]:  # (a kept process that does not answer is killed with the failed start)
            ray.cancel(ref, force=True)
    problems = {asked[r][0].node: f"the probe did not answer within {PROBE_TIMEOUT_S:g}s" for r in late}
    unable = []
    for ref in ready:
        plan, by_kept = asked[ref]
        try:
            problem = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run there is the node's problem
            if by_kept:
                unable.append(plan)
                continue
            problem = f"the probe failed: {type(exc).__name__}: {exc}"
        if problem is not None:
            problems[plan.node] = problem
    return problems, unable
