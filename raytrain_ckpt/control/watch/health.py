"""A short health probe of a node before it gets a rank again after one of its ranks failed.

A zero-CPU Ray task pinned to the node checks that a process there starts and answers (within
``PROBE_TIMEOUT_S``), that the staging file system (``/dev/shm``) has room for the ranks' staging
buffers, and that the checkpoint root (a local one) can be written. A node that fails the probe is
quarantined at once (``control/watch/quarantine.py``) and the attempt's start fails, so the next one is placed
around it.

On a GPU job (``resources.gpus > 0``) the probe also runs a ``GPU_CHECK_N`` square matmul of ones
on each device it sees and synchronizes (the result must be ``GPU_CHECK_N`` everywhere), within
``GPU_CHECK_TIMEOUT_S``. It gets its device the way a rank does: it runs in a free bundle of the
job's own placement group on that node (``plan_probes``), asking that bundle's GPUs. The probe runs
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
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)

__all__ = ["MIN_SHM_FREE", "ProbePlan", "gpu_problem", "node_problem", "plan_probes", "probe_nodes"]

PROBE_TIMEOUT_S = 20.0
MIN_SHM_FREE = 64 * 2**20
"""The least free space on the staging file system a node must have to get a rank (64 MiB)."""
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


def node_problem(shm: Path, root: str | None, min_free: int = MIN_SHM_FREE) -> str | None:
    """What is wrong with this node for a rank (None: healthy): the staging file system ``shm``
    short of ``min_free`` bytes, or the local checkpoint ``root`` not writable."""
    try:
        st = os.statvfs(shm)
    except OSError as exc:
        return f"the staging file system {shm} cannot be read: {exc}"
    free = st.f_bavail * st.f_frsize
    if free < min_free:
        return f"the staging file system {shm} has {free / 2**20:.0f} MiB free, under {min_free / 2**20:.0f} MiB"
    if root is not None:
        probe = Path(root) / f".health-{uuid.uuid4().hex[:12]}"
        try:
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            return f"the checkpoint root {root} cannot be written: {exc}"
    return None


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
    from raytrain_ckpt.checkpoint.datapath.buffers import shm_dir

    return node_problem(shm_dir(), root) or (gpu_problem() if gpu else None)


@ray.remote(num_cpus=0)
def _probe(root: str | None) -> str | None:
    return _check_node(root, False)


# max_calls=1 (which .options() cannot set, hence two functions): the process exits after the
# probe, with a GPU check's thread that may be stuck and the CUDA context it made.
@ray.remote(num_cpus=0, max_calls=1)
def _probe_gpu(root: str | None) -> str | None:
    return _check_node(root, True)


def _submit(plan: ProbePlan, root: str | None, pg: Any) -> ray.ObjectRef:
    if not plan.checks_gpu or pg is None:
        strategy = NodeAffinitySchedulingStrategy(plan.node, soft=False)
        return _probe.options(scheduling_strategy=strategy).remote(root)
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=plan.bundle)
    return _probe_gpu.options(num_gpus=plan.gpus, scheduling_strategy=strategy).remote(root)


def probe_nodes(plans: list[ProbePlan], root: str | None, pg: Any = None) -> dict[str, str]:
    """Probe each node (concurrently) as ``plans`` say (GPU checks run in ``pg``'s bundles);
    returns node id -> problem for those that failed."""
    refs = {}
    for plan in plans:
        if plan.gpus > 0 and not plan.checks_gpu:
            logger.info("node %s: its GPU is not checked (every bundle there holds a kept rank)", plan.node[:12])
        refs[_submit(plan, root, pg)] = plan.node
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    for ref in late:  # a stuck probe must not keep its bundle's GPU from the rank
        ray.cancel(ref, force=True)
    problems = {refs[r]: f"the probe did not answer within {PROBE_TIMEOUT_S:g}s" for r in late}
    for ref in ready:
        try:
            problem = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run there is the node's problem
            problem = f"the probe failed: {type(exc).__name__}: {exc}"
        if problem is not None:
            problems[refs[ref]] = problem
    return problems
