"""The poll's calls to its ranks: every rank's progress, one ``node_progress`` call per node
(``rank/progress.py``: the files a rank's node answers from), then ``progress`` calls for the
ranks a node could not answer for."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError

from raytrain_ckpt.common.events import NodeProgress, Progress
from raytrain_ckpt.rank.progress import node_batches

__all__ = ["poll_progress"]


def poll_progress(workers: Sequence[Any], nodes: Sequence[str], ranks: Sequence[int],
                  timeout_s: float) -> dict[int, Progress]:
    """The progress of ``ranks``: one ``node_progress`` call per node, then ``progress`` calls for
    the ranks a node could not answer for, all within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    batches = {workers[b[0]].node_progress.remote(b): b for b in node_batches(ranks, nodes) if len(b) > 1}
    asked = {workers[b[0]].progress.remote(): b[0] for b in node_batches(ranks, nodes) if len(b) == 1}
    out: dict[int, Progress] = {}
    ready, _ = ray.wait(list(batches), num_returns=len(batches), timeout=timeout_s) if batches else ([], [])
    for ref in ready:
        try:
            answer: NodeProgress = ray.get(ref)
        except RayActorError:  # the node's asked rank died (its run() ref says so): ask the others
            asked |= {workers[r].progress.remote(): r for r in batches[ref][1:]}
            continue
        out |= answer.progress
        asked |= {workers[r].progress.remote(): r for r in answer.ask}
    left = max(0.0, deadline - time.monotonic())
    ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=left) if asked else ([], [])
    for ref in ready:
        try:
            p = ray.get(ref)
        except RayActorError:  # the run() ref of a dead actor reports the death; nothing to add here
            continue
        out[p.rank] = p
    return out

