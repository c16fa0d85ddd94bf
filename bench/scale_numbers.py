"""``bench/scale.py --numbers``: the first save's global plan computed on the ranks' plans as
numbers (``checkpoint/format/plannumbers.py``) at N simulated ranks.

Sampled ranks (0, 1, N/2, N-1) make their real local plans (``scale_ranks.local_plan``, DCP's
planner) and are turned into numbers by ``PlanBook.add``, as the coordinator would on arrival.
Every other rank's numbers are what its plan would give: rank 1's marks and own items (its RNG
states, renamed for the rank) and its shards' offsets and sizes by ``Shard(0)``'s arithmetic,
checked against the sampled ranks' real numbers. Then ``plan_on_numbers`` (dedup, indices,
``Metadata``) and one rank's central plan expanded, timed, with the process's memory.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from array import array
from typing import Any

import numpy as np

from bench.scale_ranks import MODELS, local_plan, template
from raytrain_ckpt.checkpoint.format.plannumbers import PlanBook, PlanNumbers, central
from raytrain_ckpt.checkpoint.format.plannumbers_global import plan_on_numbers
from raytrain_ckpt.common.gcpause import collector_paused

__all__ = ["numbers_lines", "numbers_row"]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _renamed(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, tuple):
        return tuple(_renamed(v, old, new) for v in value)
    return value


def _numbers_of(book: PlanBook, n: int) -> np.ndarray:
    """Every rank's row of shard numbers (offsets, sizes) by ``Shard(0)`` over ``n`` ranks."""
    base = book.bases[0]
    rows = np.zeros((n, base.width[-1]), dtype=np.int64)
    r = np.arange(n, dtype=np.int64)
    for s, p in enumerate(base.shard_at):
        size = list(base.plan.items[p].tensor_data.size)
        nd, at = len(size), base.width[s]
        chunk = -(-size[0] // n)
        start = np.minimum(r * chunk, size[0])
        rows[:, at] = start
        rows[:, at + nd] = np.maximum(np.minimum(size[0], r * chunk + chunk) - start, 0)
        for d in range(1, nd):
            rows[:, at + nd + d] = size[d]
    return rows


def numbers_row(spec: Any, model: str, n: int) -> dict[str, Any]:
    shape = template(spec, MODELS[model])
    sample = sorted({r for r in (0, 1, n // 2, n - 1) if 0 <= r < n})
    book, pns = PlanBook(), [None] * n
    t0 = time.perf_counter()
    for r in sample:
        pns[r] = book.add(local_plan(shape, r, n))
    add_s = (time.perf_counter() - t0) / len(sample)  # (the plan's own making included)
    rows = _numbers_of(book, n)
    for r in sample:  # the arithmetic is DTensor's: the sampled ranks' real numbers
        assert np.array_equal(np.frombuffer(pns[r].numbers.tobytes(), dtype=np.int64), rows[r]), r
    if n > 1:
        one = pns[1]
        for r in range(n):
            if pns[r] is not None:
                continue
            own = {p: dataclasses.replace(item, index=dataclasses.replace(
                item.index, fqn=item.index.fqn.replace("rank1.", f"rank{r}."))) for p, item in one.own.items()}
            planner = {p: (_renamed(k, "rank1.", f"rank{r}."), _renamed(v, "rank1.", f"rank{r}."))
                       for p, (k, v) in one.planner.items()}
            pns[r] = PlanNumbers(one.base, one.marks, array("q", rows[r].tobytes()), own, planner, None,
                                 one.storage_data, one.usable)
    held = sum(len(p.marks) + p.numbers.itemsize * len(p.numbers) for p in pns) / 1e6
    t0 = time.perf_counter()
    with collector_paused():
        got = plan_on_numbers(book, pns)
    plan_s = time.perf_counter() - t0
    assert got is not None
    centrals, metadata = got
    t0 = time.perf_counter()
    with collector_paused():
        mine = central(book, pns[n - 1], centrals[n - 1])
    central_s = time.perf_counter() - t0
    chunks = sum(len(v.chunks) for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks"))
    items = sum(len(p.marks) for p in pns)
    return {"model": model, "n": n, "items": items, "chunks": chunks, "add_s": add_s, "plan_s": plan_s,
            "central_s": central_s, "central_items": len(mine.items), "held_mb": held, "peak_mb": _peak_mb()}


def numbers_lines(r: dict[str, Any]) -> list[str]:
    return [f"{r['items']} local-plan items as numbers ({r['held_mb']:.0f} MB of the process's peak for the "
            f"ranks'); global plan on numbers {r['plan_s']:.2f} s ({r['chunks']} chunks in .metadata), one rank's "
            f"central plan expanded in {r['central_s']:.3f} s ({r['central_items']} items); process peak "
            f"{r['peak_mb']:.0f} MB"]
