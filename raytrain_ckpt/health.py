"""A short health probe of a node before it gets a rank again after one of its ranks failed.

A zero-CPU Ray task pinned to the node checks that a process there starts and answers (within
``PROBE_TIMEOUT_S``), that the staging file system (``/dev/shm``) has room for the ranks' staging
buffers, and that the checkpoint root (a local one) can be written. A node that fails the probe is
quarantined at once (``quarantine.py``) and the attempt's start fails, so the next one is placed
around it. Not probed yet: on GPU, a small matmul and a collective on the device.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = ["MIN_SHM_FREE", "node_problem", "probe_nodes"]

PROBE_TIMEOUT_S = 20.0
MIN_SHM_FREE = 64 * 2**20
"""The least free space on the staging file system a node must have to get a rank (64 MiB)."""


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


@ray.remote(num_cpus=0)
def _probe(root: str | None) -> str | None:
    from raytrain_ckpt.checkpoint.datapath.buffers import shm_dir

    return node_problem(shm_dir(), root)


def probe_nodes(nodes: list[str], root: str | None) -> dict[str, str]:
    """Probe each node (concurrently); returns node id -> problem for those that failed."""
    refs = {_probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(root): n
            for n in dict.fromkeys(nodes)}
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    problems = {refs[r]: f"the probe did not answer within {PROBE_TIMEOUT_S:g}s" for r in late}
    for ref in ready:
        try:
            problem = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run there is the node's problem
            problem = f"the probe failed: {type(exc).__name__}: {exc}"
        if problem is not None:
            problems[refs[ref]] = problem
    return problems
