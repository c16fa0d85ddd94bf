"""``bench/scale.py --numbers``: the CheckpointActor's first-save plan at N simulated ranks, with
the ranks' plans sent as they are (``roles/planning.py``'s ``plan_to_send``): rank 0 its plan, every
other rank its difference from it (``checkpoint/format/plannumbers.py``).

Sampled ranks (1, N/2, N-1) make their differences from their real local plans
(``scale_ranks.local_plan``, DCP's planner); every other rank's is rank 1's with its shards'
offsets and sizes by ``Shard(0)``'s arithmetic (checked against the sampled ranks') and its own
items (its RNG states) renamed for the rank. Then the actor's ``GatheredPlans``: each rank's
arrival, then the global plan (DCP's dedup and global plan on the numbers, DCP's chunk check, each
rank's ``CentralNumbers``), timed, with the sizes each way and the process's peak memory.

Then the first commit's ``.metadata`` as the coordinator makes it (``roles/metadatafile.py``):
each rank's write results as its writer reports them (``RankResults``: one entry per chunk of the
global plan, in the file of the rank that writes it, byte items after its tensors) pickled in a
report, unpickled as the actor receives them, the file laid out from them (``metaemit``), then
filled, written and fsynced; and a later save whose every byte item grew, spliced; each timed.
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
    arrays: dict = {}
    parts, metadata = gathered.build(n, spread=False, chunk_arrays=arrays)
    plan_s = time.perf_counter() - t0
    chunks = sum(len(v.chunks) for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks"))
    back = sum(len(pickle.dumps(parts[r], protocol=5)) for r in (0, n - 1)) / 2
    return {"model": model, "n": n, "chunks": chunks, "rank_s": rank_s, "wire_kb": wire / 1e3, "held_mb": held,
            "add_s": add_s, "plan_s": plan_s, "back_kb": back / 1e3, "peak_mb": _peak_mb(),
            **(commit_row(metadata, n, arrays) if commit else {})}


def rank_numbers(metadata: Any, n: int, chunks: dict | None = None) -> list[Any]:
    """Each rank's write results for ``metadata`` as its writer reports them (``RankResults``):
    chunk ``i`` of a tensor written by rank ``i % n`` (FSDP2's ``Shard(0)``: one chunk a rank) into
    the rank's one file, its byte items (those its key names, the rest rank 0's) after its tensors.
    Made from the plan's arrays, a few numpy operations per rank."""
    from raytrain_ckpt.checkpoint.format.metarows import PlanArrays
    from raytrain_ckpt.checkpoint.format.rankresults import RankResults

    plan = PlanArrays.of(metadata, chunks)
    width = max((len(t.size) for t in plan.tensors), default=0)
    cols: dict[str, list[np.ndarray]] = {"fqn": [], "index": [], "nd": [], "off": [], "len": [], "rank": []}
    for gid, t in enumerate(plan.tensors):
        k, nd = t.offsets.shape
        off = np.zeros((k, width), dtype=np.int64)
        off[:, :nd] = t.offsets
        cols["fqn"].append(np.full(k, gid, dtype=np.int64))
        cols["index"].append(np.arange(k, dtype=np.int64))
        cols["nd"].append(np.full(k, nd, dtype=np.int64))
        cols["off"].append(off)
        cols["len"].append(t.properties.dtype.itemsize * np.prod(t.sizes, axis=1, dtype=np.int64))
        cols["rank"].append(np.arange(k, dtype=np.int64) % n)
    c = {name: np.concatenate(v) if v else np.zeros((0, width) if name == "off" else 0, dtype=np.int64)
         for name, v in cols.items()}
    order = np.argsort(c["rank"], kind="stable")
    bounds = np.searchsorted(c["rank"][order], np.arange(n + 1))
    byte_of: list[list[str]] = [[] for _ in range(n)]
    for fqn in plan.byte_fqns:
        digits = fqn.split("rank", 1)[-1].split(".", 1)[0]
        byte_of[int(digits) if digits.isdigit() and int(digits) < n else 0].append(fqn)
    names = tuple(plan.fqns)
    out = []
    for r in range(n):
        seg = order[bounds[r]:bounds[r + 1]]
        k, b = len(seg), len(byte_of[r])
        keys = np.zeros((k + b, 3 + width), dtype=np.int64)
        keys[:k, 0], keys[:k, 1], keys[:k, 2], keys[:k, 3:] = c["fqn"][seg], c["index"][seg], c["nd"][seg], c["off"][seg]
        keys[k:, 0] = len(names) + np.arange(b)
        keys[k:, 1:3] = -1
        length = np.concatenate([c["len"][seg], np.full(b, 600, dtype=np.int64)])
        where = np.zeros((k + b, 3), dtype=np.int64)
        where[:, 1] = np.cumsum(length) - length
        where[:, 2] = length
        out.append(RankResults(names, tuple(byte_of[r]), (f"__{r}_0.distcp",), keys, where))
    return out


def _longer_byte_items(results: Any, plan: Any) -> Any:
    """``results`` with each byte item (laid after the tensors) 7 bytes longer: what a pickled
    counter or RNG state of a new length does to a save's results."""
    import dataclasses as dc

    from raytrain_ckpt.checkpoint.format.metarows import byte_rows

    where = results.where.copy()
    own = byte_rows(plan, results)
    where[own, 2] += 7
    where[:, 1] = np.cumsum(where[:, 2]) - where[:, 2]
    return dc.replace(results, where=where)


def commit_row(metadata: Any, n: int, chunks: dict | None = None) -> dict[str, Any]:
    """The first commit's ``.metadata`` at ``n`` ranks: the reports' results in, the file made and
    written (fsynced); then a save whose byte items all moved, spliced."""
    import os
    import tempfile

    from raytrain_ckpt.checkpoint.records import RankReport
    from raytrain_ckpt.checkpoint.roles.metadatafile import MetadataFiles

    numbers = rank_numbers(metadata, n, chunks)
    # as the writers send them: a node's reports in one batch (8 a node), its shared names pickled once
    made = [RankReport(1, r, 0, "bench", rr, digest=rr.digest()) for r, rr in enumerate(numbers)]
    wires = [pickle.dumps(tuple(made[at:at + 8]), protocol=5) for at in range(0, n, 8)]
    del numbers, made
    t0 = time.perf_counter()
    reports = [rep for w in wires for rep in pickle.loads(w)]
    reports = [dataclasses.replace(rep, results=rep.results.interned()) for rep in reports]
    in_s = time.perf_counter() - t0
    wire_mb = sum(len(w) for w in wires) / 1e6
    del wires
    files = MetadataFiles()
    files.planned("bench", chunks or {})
    t0 = time.perf_counter()
    file = files.make("bench", metadata, reports)
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(dir=os.environ.get("SCALE_TMP")) as d:
        t0 = time.perf_counter()
        with open(os.path.join(d, ".metadata"), "wb") as f:
            file.write_to(f)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
    plan = files._arrays("bench", metadata)
    moved = []
    for rep in reports:
        rr = _longer_byte_items(rep.results, plan)
        moved.append(dataclasses.replace(rep, step=2, results=rr, digest=rr.digest()))
    t0 = time.perf_counter()
    spliced = files.make("bench", metadata, moved)
    splice_s = time.perf_counter() - t0
    assert files.spliced == 1 and spliced.size == file.size
    return {"results_mb": wire_mb, "results_in_s": in_s, "build_s": build_s, "write_s": write_s,
            "splice_s": splice_s, "metadata_mb": file.size / 1e6, "commit_peak_mb": _peak_mb()}


def numbers_lines(r: dict[str, Any]) -> list[str]:
    return [f"a rank makes its difference in {r['rank_s']:.3f} s, {r['wire_kb']:.0f} KB to the actor; the actor "
            f"takes them all in {r['add_s']:.2f} s ({r['held_mb']:.0f} MB held) and plans in {r['plan_s']:.2f} s "
            f"({r['chunks']} chunks in .metadata), {r['back_kb']:.0f} KB back to a rank; process peak "
            f"{r['peak_mb']:.0f} MB"] + ([
        f"first commit: the reports' results {r['results_mb']:.0f} MB, unpickled in {r['results_in_s']:.2f} s; "
        f".metadata ({r['metadata_mb']:.0f} MB) laid out in {r['build_s']:.2f} s, filled, written and fsynced "
        f"in {r['write_s']:.2f} s; a save whose byte items all moved spliced in {r['splice_s']:.3f} s; "
        f"process peak {r['commit_peak_mb']:.0f} MB"] if "build_s" in r else [])
