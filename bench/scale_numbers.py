"""``bench/scale.py --numbers``: the CheckpointActor's first-save plan at N simulated ranks, with
the ranks' plans sent as they are (``roles/planning.py``'s ``plan_to_send``): rank 0 its plan, every
other rank its difference from it (``checkpoint/format/plannumbers.py``).

Sampled ranks (1, N/2, N-1) make their differences from their real local plans
(``scale_ranks.local_plan``, DCP's planner); every other rank's is rank 1's with its shards'
offsets and sizes by ``Shard(0)``'s arithmetic (checked against the sampled ranks') and its own
items (its RNG states) renamed for the rank. Then the actor's ``GatheredPlans``: each rank's
arrival, then the global plan (DCP's dedup and global plan on the numbers, DCP's chunk check, each
rank's ``CentralNumbers``), timed, with the sizes each way and the process's peak memory.

Then the first commit's ``.metadata`` as the coordinator builds it today (``metapickle.build``):
each rank's write results (one ``WriteResult`` per chunk of the global plan, in the file of the
rank that writes it, byte items after its tensors) pickled as a report carries them, unpickled as
the actor receives them, and the file built from them, each timed.
"""

from __future__ import annotations

import dataclasses
import pickle
import resource
import time
from array import array
from typing import Any

import numpy as np

from bench.scale_ranks import MODELS, local_plan, template
from raytrain_ckpt.checkpoint.format.plannumbers import PlanBook, SharedPlan, difference_from
from raytrain_ckpt.checkpoint.roles.planning import GatheredPlans

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


def numbers_row(spec: Any, model: str, n: int, commit: bool = False) -> dict[str, Any]:
    """The CheckpointActor's whole first-save plan at ``n`` ranks, as the ranks send it: rank 0 its
    plan (``SharedPlan``), every other rank its difference from it (``difference_from``). Sampled
    ranks make theirs from their real plans; the others' are rank 1's, their shards' numbers by
    ``Shard(0)``'s arithmetic (checked against the sampled ranks') and its own items renamed."""
    shape = template(spec, MODELS[model])
    sample = sorted({r for r in (0, 1, n // 2, n - 1) if 0 <= r < n})
    plans = {r: local_plan(shape, r, n) for r in sample}
    sent: list[Any] = [None] * n
    sent[0] = SharedPlan(plans[0])
    t0 = time.perf_counter()
    for r in sample[1:]:
        sent[r] = difference_from(plans[0], plans[r], 0)
    rank_s = (time.perf_counter() - t0) / max(1, len(sample) - 1)
    book = PlanBook()
    book.add_base(plans[0])
    rows = _numbers_of(book, n)
    for r in sample[1:]:  # the arithmetic is DTensor's: the sampled ranks' real numbers
        assert np.array_equal(np.frombuffer(sent[r].numbers.tobytes(), dtype=np.int64), rows[r]), r
    wire = sum(len(pickle.dumps(sent[r], protocol=5)) for r in sample[1:]) / max(1, len(sample) - 1)
    if n > 1:
        one = sent[1]
        for r in range(2, n):
            if sent[r] is not None:
                continue
            own = {p: dataclasses.replace(item, index=dataclasses.replace(
                item.index, fqn=item.index.fqn.replace("rank1.", f"rank{r}."))) for p, item in one.own.items()}
            planner = {p: (_renamed(k, "rank1.", f"rank{r}."), _renamed(v, "rank1.", f"rank{r}."))
                       for p, (k, v) in one.planner.items()}
            sent[r] = dataclasses.replace(one, numbers=array("q", rows[r].tobytes()), own=own, planner=planner)
    held = sum(len(p.marks) + p.numbers.itemsize * len(p.numbers) for p in sent[1:]) / 1e6
    gathered = GatheredPlans()
    t0 = time.perf_counter()
    for r in range(n):
        gathered.add(r, sent[r])
    add_s = time.perf_counter() - t0
    del plans, sent
    t0 = time.perf_counter()
    parts, metadata = gathered.build(n, spread=False)
    plan_s = time.perf_counter() - t0
    chunks = sum(len(v.chunks) for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks"))
    back = sum(len(pickle.dumps(parts[r], protocol=5)) for r in (0, n - 1)) / 2
    return {"model": model, "n": n, "chunks": chunks, "rank_s": rank_s, "wire_kb": wire / 1e3, "held_mb": held,
            "add_s": add_s, "plan_s": plan_s, "back_kb": back / 1e3, "peak_mb": _peak_mb(),
            **(commit_row(metadata, n) if commit else {})}


def _rank_results(metadata: Any, n: int) -> list[list[Any]]:
    """Each rank's write results for ``metadata``: chunk ``i`` of a tensor written by rank ``i``
    (FSDP2's ``Shard(0)``: one chunk a rank), a byte item by the rank its key names or rank 0."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    out: list[list[Any]] = [[] for _ in range(n)]
    offsets = [0] * n
    byte_items = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            byte_items.append(fqn)
            continue
        width = md.properties.dtype.itemsize
        for i, chunk in enumerate(md.chunks):
            r = i % n
            length = width * int(np.prod(chunk.sizes))
            out[r].append(WriteResult(MetadataIndex(fqn, chunk.offsets, i), length,
                                      _StorageInfo(f"__{r}_0.distcp", offsets[r], length)))
            offsets[r] += length
    for fqn in byte_items:
        digits = fqn.split("rank", 1)[-1].split(".", 1)[0]
        r = int(digits) if digits.isdigit() and int(digits) < n else 0
        out[r].append(WriteResult(MetadataIndex(fqn), 600,
                                  _StorageInfo(f"__{r}_0.distcp", offsets[r], 600)))
        offsets[r] += 600
    return out


def commit_row(metadata: Any, n: int) -> dict[str, Any]:
    """The first commit's ``.metadata`` at ``n`` ranks: the reports' results in, the file built."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    from raytrain_ckpt.checkpoint.format.metapickle import build
    from raytrain_ckpt.checkpoint.roles.repeats import plan_storage_meta

    wires = [pickle.dumps(r, protocol=5) for r in _rank_results(metadata, n)]
    t0 = time.perf_counter()
    results = [pickle.loads(w) for w in wires]
    in_s = time.perf_counter() - t0
    wire_mb = sum(len(w) for w in wires) / 1e6
    del wires
    t0 = time.perf_counter()
    file = build(metadata, results, CURRENT_DCP_VERSION, plan_storage_meta("bench"))
    build_s = time.perf_counter() - t0
    return {"results_mb": wire_mb, "results_in_s": in_s, "build_s": build_s, "metadata_mb": len(file.data) / 1e6,
            "commit_peak_mb": _peak_mb()}


def numbers_lines(r: dict[str, Any]) -> list[str]:
    return [f"a rank makes its difference in {r['rank_s']:.3f} s, {r['wire_kb']:.0f} KB to the actor; the actor "
            f"takes them all in {r['add_s']:.2f} s ({r['held_mb']:.0f} MB held) and plans in {r['plan_s']:.2f} s "
            f"({r['chunks']} chunks in .metadata), {r['back_kb']:.0f} KB back to a rank; process peak "
            f"{r['peak_mb']:.0f} MB"] + ([
        f"first commit: the reports' results {r['results_mb']:.0f} MB, unpickled in {r['results_in_s']:.2f} s; "
        f".metadata ({r['metadata_mb']:.0f} MB) built in {r['build_s']:.2f} s; process peak "
        f"{r['commit_peak_mb']:.0f} MB"] if "build_s" in r else [])
