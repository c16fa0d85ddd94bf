"""Scale benchmark: the checkpoint control plane's per-save and per-poll costs against the rank count.

N simulated ranks (``bench/scale_ranks.py``: each rank's real DCP local save plan for an FSDP2
shard of the 8B or 70B model, computed from its shape, no tensor bytes) drive the real
``CheckpointActor`` (as a plain object, the way tests drive it; ``--ray``: also as a Ray actor,
for N <= 64, timed from the caller) through two saves of one attempt, as the ranks' and writers' calls would:

* the first save of the attempt: every rank's ``plan`` (the global plan and ``.metadata``,
  built once per layout) and ``open_step``, then, per node of ``--per-node`` ranks, the calls its
  writer makes for them (``roles/courier.py``): one ``node_report`` with its ranks' hand-offs and
  one with their reports and stalls (the last one commits);
* a later save of the same attempt: the same calls without ``plan`` (the plan is cached); each
  rank's results equal the first save's, so the writers send them as a digest
  (``roles/repeats.py``) and the actor copies the first save's ``.metadata``;
* a third save whose byte items are each a byte longer (a counter that gained a digit): every
  rank's results differ, so they are sent in full and ``.metadata`` is built again (the byte
  items lie among the tensors, so every tensor after one moves);
* two more saves whose byte items lie after every tensor (``write_results(bytes_last=True)``):
  the first moves the tensors (built in full: the ``bytes-last build`` columns), the second's
  byte items are again a byte longer and no tensor moves, so ``.metadata`` is spliced from the
  last one (``roles/metadatafile.py``: the ``spliced`` columns). The writers send the digest of
  each rank's tensor results with its report, made where the results are (``writer digest ms``:
  the longest one rank's took; not the actor's time), so the coordinator reads no rank's results
  to decide the splice.

The writers' files exist as sparse files of the sizes the reports name, so the commit checks,
``ls``/``status`` and the resume plan's verification see a real step directory. Printed per N:
the plan's build time (and, each in a forked child stopped at ``SCALE_DCP_CAP_S``, the
coordinator's planner alone and DCP's ``DefaultSavePlanner.create_global_plan`` on the same local
plans: the peer column), the ``.metadata`` size, the commit time, the coordinator's work per save
(the sum of its methods' time for the second save), the calls and pickled bytes into the actor
per save, the process's peak memory growth during the coordinator's work, the time the actor's
check of the newest commit took (``roles/resumecheck.py``, off the save path), the resume plan
(``acquire``: verify the newest step to sizes and lease it) once that check is done (a restart
while the actor lives), the resume plan and ``ls``/``status`` on the root in a process that has
checked nothing (``cold``: a fresh actor on another machine, a new command), each again, and the
check and the resume plan after one more save that wrote a new ``.metadata``;
then each figure's growth exponent (the slope of log(figure) over log(N) between the two
largest N), where 1.0 is linear.

With ``--poll``, also one controller poll round of the real ``RayWorkerGroup.poll`` over N
ranks served by a few real Ray actors (every rank's ``run`` ref and ``progress`` call are real
Ray calls; several ranks share an actor, so the actors' side is serialised over fewer processes
than a real group has).

    .venv/bin/python bench/scale.py                       # 8b and 70b at 8, 64, 512 ranks
    .venv/bin/python bench/scale.py --check-only --sizes 8 64 512 4096   # the first save's plan check
    .venv/bin/python bench/scale.py --prefixes --sizes 512 4096          # object-store requests a save
    .venv/bin/python bench/scale.py --wire --sizes 64 512 4096           # the first save's plans on the wire
    .venv/bin/python bench/scale.py --calls-only --ray --sizes 512 4096  # a later save's calls into the actor
    .venv/bin/python bench/scale.py --sizes 8 64 512 --models 70b --poll
    .venv/bin/python bench/scale.py --sizes 8 64 512 4096 --poll-only
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.scale_numbers import numbers_lines, numbers_row  # noqa: E402
from bench.scale_ranks import MODELS, local_plan, template, write_results  # noqa: E402

from raytrain_ckpt.checkpoint.format.plannumbers import SharedPlan, difference_from, own_central
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy  # noqa: E402
from raytrain_ckpt.checkpoint.records import CentralPlan, GroupLayout, NodeBatch, RankReport, TrainingPoint  # noqa: E402
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor, actor_concurrency  # noqa: E402
from raytrain_ckpt.checkpoint.roles.repeats import SentResults  # noqa: E402
from raytrain_ckpt.checkpoint.format.rankresults import RankResults  # noqa: E402
from raytrain_ckpt.control.preflight import load_spec  # noqa: E402


def _spec() -> Any:
    return load_spec(str(REPO / "jobs/llama_debug_fsdp.yaml"), [])


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Calls:
    """Calls and pickled bytes into the actor, per method (what Ray would serialise)."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.report_bytes = 0
        """Of ``bytes``, the ranks' reports."""

    def add(self, method: str, *args: Any) -> None:
        self.count[method] = self.count.get(method, 0) + 1
        self.bytes[method] = self.bytes.get(method, 0) + len(pickle.dumps(args, protocol=5))

    def total(self) -> tuple[int, int]:
        return sum(self.count.values()), sum(self.bytes.values())


PER_NODE = 8
"""Ranks per node (``--per-node``): each node's writer carries its ranks' calls into the actor."""


def _nodes(n: int) -> list[list[int]]:
    return [list(range(a, min(a + PER_NODE, n))) for a in range(0, n, PER_NODE)]


WRITER_S: dict[int, float] = {}
"""step -> the longest time one rank's report took its writer to digest (``SentResults.slim``)."""


async def _save(actor: CheckpointActor, n: int, step: int, attempt: int, centrals: list[Any],
                calls: _Calls, sent: SentResults, bytes_last: bool = False) -> float:
    """One save of every rank after planning: the actor's time in its methods, in seconds.
    ``sent``: what the writers delivered before (a rank's unchanged results go as a digest)."""
    reports, spent = [], 0.0
    tmp = None
    for rank in range(n):
        calls.add("open_step", step, attempt)
        t0 = time.perf_counter()
        tmp = await actor.open_step(step, attempt)
        spent += time.perf_counter() - t0
    assert tmp is not None
    for rank in range(n):
        results = write_results(centrals[rank].plan, step, bytes_last)
        name = results[0].storage_data.relative_path
        size = results[-1].storage_data.offset + results[-1].storage_data.length
        with open(os.path.join(tmp, name), "wb") as f:  # sparse: the writer's file, without its bytes
            f.truncate(size)
        t0 = time.perf_counter()  # the writer's numbers and digest (each writer does its ranks'), not the actor's time
        reports.append(sent.slim(RankReport(step, rank, attempt, centrals[rank].plan_id, RankResults.of(results),
                                            {name: {"size": size, "crc32c": 0}}, TrainingPoint(samples_seen=step))))
        WRITER_S[step] = max(WRITER_S.get(step, 0.0), time.perf_counter() - t0)
    for ranks in _nodes(n):
        batch = NodeBatch(None, tuple((step, r, attempt) for r in ranks))
        calls.add("node_report", batch)
        t0 = time.perf_counter()
        await actor.node_report(batch)
        spent += time.perf_counter() - t0
    for ranks in _nodes(n):
        batch = NodeBatch(None, (), tuple(reports[r] for r in ranks), tuple((step, r, 0.01) for r in ranks))
        calls.add("node_report", batch)
        calls.report_bytes += len(pickle.dumps(batch.reports, protocol=5))
        t0 = time.perf_counter()
        answer = await actor.node_report(batch)
        spent += time.perf_counter() - t0
        for r in ranks:
            sent.delivered(reports[r])
    assert answer.reports[-1] == "committed", answer
    return spent


async def _plan(actor: CheckpointActor, n: int, step: int, attempt: int, plans: list[Any],
                calls: _Calls) -> tuple[list[Any], float]:
    # What each rank sends (``planning.plan_to_send``, made on the ranks in parallel: not timed):
    # rank 0 its plan, shared with the others by a broadcast; each other rank its difference from it.
    sent = [SharedPlan(plans[0])] + [difference_from(plans[0], p, 0) or p for p in plans[1:]]
    for rank in range(n):
        calls.add("plan", attempt, step, rank, sent[rank], 600.0)
    t0 = time.perf_counter()
    centrals = await asyncio.gather(*(actor.plan(attempt, step, r, sent[r], 600.0) for r in range(n)))
    spent = time.perf_counter() - t0
    # Each rank makes its central plan from its own local plan (on the ranks, in parallel: not timed here).
    return [CentralPlan(own_central(c.plan, plans[r]), c.plan_id) for r, c in enumerate(centrals)], spent


def one(model: str, n: int) -> dict[str, Any]:
    """Every figure of one model at ``n`` ranks (run in its own process: its peak memory is its own)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from raytrain_ckpt.checkpoint.format.planchecks import global_plan

    out: dict[str, Any] = {"model": model, "n": n}
    t0 = time.perf_counter()
    shape = template(_spec(), MODELS[model])
    plans = [local_plan(shape, r, n) for r in range(n)]
    out["simulate_s"] = time.perf_counter() - t0
    out["items"] = sum(len(p.items) for p in plans)
    out["plans_mb"] = _rss_mb()
    gc.collect()
    peer = _capped(lambda: DefaultSavePlanner().create_global_plan(plans), DCP_CAP_S)
    # The coordinator's planner alone, the same way (a forked child of this process's state).
    ours = _capped(lambda: global_plan(plans), DCP_CAP_S)
    out["capped"] = [k for k, v in (("dcp_global_plan_s", peer), ("global_plan_s", ours)) if v is None]
    out |= {k: v for k, v in (("dcp_global_plan_s", peer), ("global_plan_s", ours)) if v is not None}
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="scale-", dir=os.environ.get("SCALE_DIR")) as root:
        rss0 = _rss_mb()
        actor = CheckpointActor(root, RetentionPolicy(2), seal_key=SEAL_KEY)
        asyncio.run(actor.configure(GroupLayout(n, n, "scale", {"name": model})))
        first, later, changed, sent = _Calls(), _Calls(), _Calls(), SentResults()

        kept: dict[str, Any] = {}

        async def saves() -> None:
            centrals, out["plan_s"] = await _plan(actor, n, 10, 0, plans, first)
            kept["centrals"] = centrals
            out["first_save_s"] = out["plan_s"] + await _save(actor, n, 10, 0, centrals, first, sent)
            out["first_commit_s"] = actor.committed[10].wall["commit_s"]
            out["save_s"] = await _save(actor, n, 20, 0, centrals, later, sent)
            out["commit_s"] = actor.committed[20].wall["commit_s"]
            # Step 100: every byte item is a byte longer, so every rank's results differ: a full rebuild.
            out["changed_save_s"] = await _save(actor, n, 100, 0, centrals, changed, sent)
            out["changed_commit_s"] = actor.committed[100].wall["commit_s"]
            # Byte items after the tensors: step 200 moves every tensor (built in full), step 1000's
            # byte items are a byte longer again and no tensor moves: spliced.
            out["last_build_save_s"] = await _save(actor, n, 200, 0, centrals, _Calls(), sent, True)
            out["last_build_commit_s"] = actor.committed[200].wall["commit_s"]
            spliced = actor.coordinator.files.spliced
            out["spliced_save_s"] = await _save(actor, n, 1000, 0, centrals, _Calls(), sent, True)
            out["spliced_commit_s"] = actor.committed[1000].wall["commit_s"]
            out["writer_digest_ms"] = WRITER_S[1000] * 1e3
            assert actor.coordinator.files.spliced == spliced + 1, "step 1000 was not spliced"

        asyncio.run(saves())
        out["metadata_reused"] = actor.coordinator.repeats.reused
        out["peak_mb"] = _rss_mb() - rss0
        out["first_calls"], out["first_mb"] = first.total()[0], first.total()[1] / 1e6
        out["calls"], out["mb"] = later.total()[0], later.total()[1] / 1e6
        out["report_mb"] = later.report_bytes / 1e6
        out["changed_mb"] = changed.total()[1] / 1e6
        step_dir = actor.layout.step_dir(1000)
        out["metadata_mb"] = os.path.getsize(os.path.join(step_dir, ".metadata")) / 1e6
        # The actor checks each committed step's .metadata as a resume plan would, off the save
        # path (roles/resumecheck.py): a restart while the actor lives then finds the verdict.
        assert actor.resume_check.wait(600) and actor.resume_check.passed[-1] == 1000, actor.resume_check.passed
        out["resume_check_s"] = actor.resume_check.took_s
        t0 = time.perf_counter()
        point = asyncio.run(actor.acquire("bench", "latest", "size"))
        out["resume_s"] = time.perf_counter() - t0
        assert point is not None and point.step == 1000, point
        from raytrain_ckpt.report.inventory import status_report

        # A process that has checked nothing (the scan cache's disk part is off): a fresh actor on
        # another machine, and ls/status from a new command.
        _cold()
        t0 = time.perf_counter()
        point = asyncio.run(actor.acquire("bench", "latest", "size"))
        out["resume_cold_s"] = time.perf_counter() - t0
        assert point is not None and point.step == 1000, point
        _cold()
        t0 = time.perf_counter()
        text, data = status_report(root, "size")
        out["ls_status_s"] = time.perf_counter() - t0
        assert [r["step"] for r in data["steps"] if r["status"] == "valid"] == [200, 1000], data["steps"]
        # Again: each step's .metadata check passed above and is remembered by content
        # (format/scancache.py), so only the sizes and the checksum of .metadata are read.
        t0 = time.perf_counter()
        assert asyncio.run(actor.acquire("bench", "latest", "size")) is not None
        out["resume_again_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        status_report(root, "size")
        out["ls_status_again_s"] = time.perf_counter() - t0
        # One more save, its byte items a byte longer again (a new .metadata): a restart once its
        # check is done, and the check's own time after the commit.
        asyncio.run(_save(actor, n, 10000, 0, kept["centrals"], _Calls(), sent, True))
        assert actor.resume_check.wait(600) and actor.resume_check.passed[-1] == 10000, actor.resume_check.passed
        out["resume_next_check_s"] = actor.resume_check.took_s
        t0 = time.perf_counter()
        point = asyncio.run(actor.acquire("bench", "latest", "size"))
        out["resume_next_s"] = time.perf_counter() - t0
        assert point is not None and point.step == 10000, point
        # A fresh actor on another machine (Ray restarted it there; nothing checked in its process):
        # started and its resume plan made, with the run's seal key (it takes the checks the run's
        # actor sealed, roles/seals.py) and without (another run's actor, checking every step).
        for name, key in (("fresh_actor_cold_s", None), ("fresh_actor_sealed_s", SEAL_KEY)):
            _cold()
            t0 = time.perf_counter()
            fresh = CheckpointActor(root, RetentionPolicy(2), seal_key=key)
            point = asyncio.run(fresh.acquire("bench-fresh", "latest", "size"))
            out[name] = time.perf_counter() - t0
            assert point is not None and point.step == 10000, point
            asyncio.run(fresh.release("bench-fresh"))
        # A rank on another node loading that step: DCP's read of .metadata, decoded in a reader
        # process of the rank's own first, or taken as done on the plan's word (ResumePoint.metadata_key).
        from raytrain_ckpt.checkpoint.format.metadata import load_metadata
        from raytrain_ckpt.checkpoint.format.unpickling import vouch_for

        md_path = os.path.join(actor.layout.step_dir(10000), ".metadata")
        for name, keys in (("rank_read_cold_s", []), ("rank_read_vouched_s", [point.metadata_key])):
            _cold()
            vouch_for(keys)
            t0 = time.perf_counter()
            with open(md_path, "rb") as f:
                load_metadata(f, md_path)
            out[name] = time.perf_counter() - t0
    return out


SEAL_KEY = "5e" * 32
"""The benchmark run's seal key (a job's driver makes a random one per run)."""


def _cold() -> None:
    """Forget every verdict of this process: its remembered passes and its reader process (with
    the pre-scans it carries over, ``format/scandiff.py``), as a new process starts."""
    from raytrain_ckpt.checkpoint.format import sandbox, scancache

    scancache.forget()
    with sandbox._READER._lock:
        sandbox._READER._stop()


DCP_CAP_S = float(os.environ.get("SCALE_DCP_CAP_S", "300"))
"""Seconds DCP's own ``create_global_plan`` (the peer column) may take before it is stopped ("> cap")."""


def _capped(work: Any, cap_s: float) -> float | None:
    """Seconds ``work()`` took in a forked child (the plans shared, not copied), or None when it
    ran past ``cap_s`` and was stopped."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        t0 = time.perf_counter()
        work()
        send.send(time.perf_counter() - t0)

    proc = ctx.Process(target=child)
    proc.start()
    try:
        if recv.poll(cap_s):
            return recv.recv()
        return None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()


def wire_row(model: str, n: int, sample: int = 32) -> dict[str, Any]:
    """What the first save's plans cost on the wire at ``n`` ranks of ``model``: each rank's local
    plan pickled (the rank, Ray's argument serialisation) and unpickled (the CheckpointActor, one
    process, every rank's plan), measured on ``sample`` ranks spread over the ``n`` (a rank's plan
    differs from another's only in its shards' offsets and its own keys) and multiplied by ``n``;
    then the same for what each rank sends since (``roles/planning.py``'s ``plan_to_send``: its
    difference from rank 0's plan, ``plannumbers.difference_from``)."""
    from raytrain_ckpt.common.gcpause import collector_paused

    shape = template(_spec(), MODELS[model])
    ranks = sorted({round(i * (n - 1) / max(1, sample - 1)) for i in range(min(sample, n))})
    encode = decode = size = items = planner = 0.0
    base = local_plan(shape, 0, n)
    delta_size = delta_encode = delta_decode = 0.0
    for r in ranks:
        plan = local_plan(shape, r, n)
        t0 = time.perf_counter()
        delta = pickle.dumps(difference_from(base, plan, 0) or plan, protocol=5)
        delta_encode += time.perf_counter() - t0
        t0 = time.perf_counter()
        pickle.loads(delta)
        delta_decode += time.perf_counter() - t0
        delta_size += len(delta)
        t0 = time.perf_counter()
        data = pickle.dumps((0, 10, r, plan, 600.0), protocol=5)
        encode += time.perf_counter() - t0
        t0 = time.perf_counter()
        with collector_paused():  # the most favourable case for the actor: no collection meanwhile
            pickle.loads(data)
        decode += time.perf_counter() - t0
        size += len(data)
        items += len(plan.items)
        planner += len(pickle.dumps(plan.planner_data, protocol=5))
    k = n / len(ranks)
    held, shared = _held_mb(shape, ranks, n)
    return {"model": model, "n": n, "items": int(items * k), "mb": size * k / 1e6, "planner_mb": planner * k / 1e6,
            "rank_encode_s": encode / len(ranks), "actor_decode_s": decode * k,
            "delta_mb": delta_size * k / 1e6, "delta_encode_s": delta_encode / len(ranks), "delta_decode_s": delta_decode * k,
            "held_mb": held * k, "held_shared_mb": shared * k}


def _held_mb(shape: Any, ranks: list[int], n: int) -> tuple[float, float]:
    """The memory the CheckpointActor holds for the sampled ranks' unpickled local plans until the
    global plan is built (Python's allocations, ``tracemalloc``, MB), as they arrive and with the
    items and planner data equal on every rank held once (one object for each byte item and each
    key's path: what sharing alone would save; the rest is the ranks' own shards). The first
    sampled rank is left out of both (the shared copy is paid once, not per rank)."""
    import dataclasses
    import tracemalloc

    from torch.distributed.checkpoint.planner import WriteItemType

    blobs = [pickle.dumps(local_plan(shape, r, n), protocol=5) for r in ranks]

    def fold(plan: Any, items: dict, paths: dict) -> Any:
        kept = [items.setdefault(i, i) if i.type == WriteItemType.BYTE_IO else i for i in plan.items]
        data = {paths.setdefault(key, key): paths.setdefault((key,), path) for key, path in plan.planner_data.items()}
        return dataclasses.replace(plan, items=kept, planner_data=data)

    out = []
    for share in (False, True):
        items: dict = {}
        paths: dict = {}
        held = [fold(pickle.loads(blobs[0]), items, paths) if share else pickle.loads(blobs[0])]
        tracemalloc.start()
        for blob in blobs[1:]:
            plan = pickle.loads(blob)
            held.append(fold(plan, items, paths) if share else plan)
            del plan
        out.append(tracemalloc.get_traced_memory()[0] / 1e6 / max(1, len(blobs) - 1) * len(blobs))
        tracemalloc.stop()
        del held, items, paths
    return out[0], out[1]


def check_row(model: str, n: int) -> dict[str, Any]:
    """The first save's global-plan check alone at ``n`` ranks of ``model``: the ``.metadata`` of
    the FSDP2-sharded tensors (each rank's chunk by DTensor's own shard arithmetic, one chunk list
    per distinct shape, shared), checked by ``plan_problems`` and by DCP's ``_validate_global_plan``
    (in a forked child, stopped at the cap), and DCP's on the widest tensor alone."""
    import torch
    from torch.distributed.checkpoint.default_planner import _validate_global_plan
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import SavePlan
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from raytrain_ckpt.checkpoint.format.planchecks import plan_problems

    shape = template(_spec(), MODELS[model])
    by_shape: dict[tuple[int, ...], list[Any]] = {}
    entries = {}
    for section in ("model", "optim"):
        for key in sorted(shape.sharded[section]):
            size = tuple(shape.state[section][key].shape)
            if size not in by_shape:
                by_shape[size] = []
                for r in range(n):
                    sizes, offsets = _compute_local_shape_and_global_offset(size, (n,), lambda d, r=r: r, (Shard(0),))
                    by_shape[size].append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            entries[f"{section}.{key}"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                torch.Size(size), by_shape[size])
    plans = [SavePlan([]), SavePlan([])]  # (the check reads only how many there are)
    out: dict[str, Any] = {"model": model, "n": n, "tensors": len(entries),
                           "chunks": sum(len(e.chunks) for e in entries.values())}
    t0 = time.perf_counter()
    assert plan_problems(plans, Metadata(entries)) == []
    out["check_s"] = time.perf_counter() - t0
    peer = _capped(lambda: _validate_global_plan(plans, Metadata(entries)), DCP_CAP_S)
    if peer is not None:
        out["dcp_check_s"] = peer
    wide = max((k for k, e in entries.items() if len(e.size) == 2 and e.size[1] > e.size[0]),
               key=lambda k: entries[k].size[1], default=None)
    if wide is not None:
        out["wide_tensors"] = sum(len(e.size) == 2 and e.size[1] > e.size[0] for e in entries.values())
        t0 = time.perf_counter()
        assert plan_problems(plans, Metadata({wide: entries[wide]})) == []
        out["wide_check_s"] = time.perf_counter() - t0
        one = _capped(lambda: _validate_global_plan(plans, Metadata({wide: entries[wide]})), DCP_CAP_S)
        if one is not None:
            out["wide_dcp_check_s"] = one
    return out


S3_PUTS_PER_PREFIX_S = 3500
"""S3's documented request rate per partitioned prefix for PUT/COPY/POST/DELETE (GET: 5,500)."""


def prefix_row(model: str, n: int) -> dict[str, Any]:
    """Object-store requests of one save of ``n`` ranks of ``model`` under the step's prefix:
    each rank's tensor bytes from DTensor's shard arithmetic (the FSDP2 shards of the model and
    both AdamW moments; the small unsharded entries left out), one file per rank
    (``writer_threads: 1``), uploaded as ``datapath/upload.py`` does (one PUT below a part, else
    create + ``ceil(bytes / PART_SIZE)`` parts + complete), plus ``.metadata`` and the manifest."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from raytrain_ckpt.checkpoint.datapath.upload import PART_SIZE

    shape = template(_spec(), MODELS[model])
    per_rank = [0] * n
    for section in ("model", "optim"):
        for key in shape.sharded[section]:
            value = shape.state[section][key]
            for r in range(n):
                sizes, _ = _compute_local_shape_and_global_offset(tuple(value.shape), (n,), lambda d, r=r: r,
                                                                  (Shard(0),))
                per_rank[r] += math.prod(sizes) * value.dtype.itemsize
    from raytrain_ckpt.checkpoint.storage.dcp import key_spread

    by_rank = [1 if b < PART_SIZE else 2 + -(-b // PART_SIZE) for b in per_rank]
    requests = sum(by_rank) + 2
    # Requests per key range of the step's prefix, by the first character where the keys differ:
    # DCP's names (``__<rank>_0.distcp``: the rank's leading digit, after ``step-N/__``) and the
    # spread names (``<2 hex>__<rank>_0.distcp``, ``storage/dcp.py``: the first hex digit, after
    # ``step-N/``). ``.metadata`` and the manifest add one each (``.`` and ``m``).
    flat: dict[str, int] = {".": 1, "m": 1}
    spread: dict[str, int] = {".": 1, "m": 1}
    for r, k in enumerate(by_rank):
        flat[str(r)[0]] = flat.get(str(r)[0], 0) + k
        spread[key_spread(r)[0]] = spread.get(key_spread(r)[0], 0) + k
    return {"model": model, "n": n, "bytes": sum(per_rank), "file_mb": max(per_rank) / 1e6, "requests": requests,
            "prefix_s": requests / S3_PUTS_PER_PREFIX_S, "flat": flat, "spread": spread}


def calls_row(n: int) -> dict[str, Any]:
    """The calls into the actor and their pickled bytes for a later save of ``n`` ranks (the plan
    cached, every rank's results unchanged, so its report goes as a digest, as ``_save`` sends
    them): made per rank, as the ranks and writers made them before, and carried per node
    (``roles/courier.py``: each rank's ``open_step``, then per node one call with its hand-offs and
    one with its reports and stalls). No planning: a report's size does not depend on the model
    once its results go as a digest."""
    def report(r: int) -> RankReport:
        return RankReport(20, r, 0, "0.10", None, {f"{r:02x}__{r}_0.distcp": {"size": 1 << 30, "crc32c": 0}},
                          TrainingPoint(samples_seen=20), digest="0" * 64)

    per_rank, per_node = _Calls(), _Calls()
    for r in range(n):
        per_rank.add("open_step", 20, 0)
        per_rank.add("accepted", 20, r, 0, None)
        per_rank.add("report", report(r))
        per_rank.add("record_stall", 20, r, 0.01)
        per_node.add("open_step", 20, 0)
    for ranks in _nodes(n):
        per_node.add("node_report", NodeBatch(None, tuple((20, r, 0) for r in ranks)))
        per_node.add("node_report", NodeBatch(None, (), tuple(report(r) for r in ranks),
                                              tuple((20, r, 0.01) for r in ranks)))
    (c0, b0), (c1, b1) = per_rank.total(), per_node.total()
    return {"n": n, "rank_calls": c0, "rank_mb": b0 / 1e6, "node_calls": c1, "node_mb": b1 / 1e6}


def calls_timed(n: int, per_nodes: tuple[int, ...]) -> dict[int, float]:
    """Seconds from a later save's first call into a real Ray CheckpointActor to its last answer
    (``ray_saves``: each rank's ``open_step``, then its node's hand-offs and its reports with their
    stalls, each node's calls in flight together), with ``per_nodes`` ranks to a node: 1 is a call
    of each kind per rank (3 a rank, as before the node's writer carried them, less the separate
    stall), more are the node's writer speaking for its ranks. The debug model's plan (a few KB a
    rank): the calls are what is measured, not the plan or the copy of a large ``.metadata``."""
    global PER_NODE
    kept, out = PER_NODE, {}
    try:
        for per_node in per_nodes:
            PER_NODE = per_node
            out[per_node] = ray_saves("debug", n)["ray_save_s"]
    finally:
        PER_NODE = kept
    return out


def ray_saves(model: str, n: int) -> dict[str, float]:
    """The same two saves through the CheckpointActor as a Ray actor (every call a real Ray call,
    the ranks' calls in flight together, as the trainers and writers make them): seconds from
    the first call to the last answer, for the first save (with ``plan``) and a later one."""
    import ray

    from raytrain_ckpt.checkpoint.records import RankReport as Report

    shape = template(_spec(), MODELS[model])
    plans = [local_plan(shape, r, n) for r in range(n)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    out: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="scale-ray-", dir=os.environ.get("SCALE_DIR")) as root:
            actor = ray.remote(CheckpointActor).options(num_cpus=0, max_concurrency=actor_concurrency(n)).remote(
                root, RetentionPolicy(2))
            ray.get(actor.configure.remote(GroupLayout(n, n, "scale", {"name": model})))
            sent = SentResults()
            t0 = time.perf_counter()
            shared = [SharedPlan(plans[0])] + [difference_from(plans[0], p, 0) or p for p in plans[1:]]
            centrals = ray.get([actor.plan.remote(0, 10, r, shared[r], 600.0) for r in range(n)])
            centrals = [CentralPlan(own_central(c.plan, plans[r]), c.plan_id) for r, c in enumerate(centrals)]
            plan_s = time.perf_counter() - t0
            for key, step in (("ray_first_save_s", 10), ("ray_save_s", 20)):
                t0 = time.perf_counter()
                tmp = ray.get([actor.open_step.remote(step, 0) for _ in range(n)])[0]
                open_s = time.perf_counter() - t0
                reports = []
                for rank in range(n):
                    results = write_results(centrals[rank].plan, step)
                    name = results[0].storage_data.relative_path
                    size = results[-1].storage_data.offset + results[-1].storage_data.length
                    with open(os.path.join(tmp, name), "wb") as f:
                        f.truncate(size)
                    reports.append(sent.slim(Report(step, rank, 0, centrals[rank].plan_id, RankResults.of(results),
                                                    {name: {"size": size, "crc32c": 0}},
                                                    TrainingPoint(samples_seen=step))))
                t0 = time.perf_counter()
                nodes = _nodes(n)
                ray.get([actor.node_report.remote(NodeBatch(None, tuple((step, r, 0) for r in rs))) for rs in nodes])
                answers = ray.get([actor.node_report.remote(NodeBatch(None, (), tuple(reports[r] for r in rs),
                                                                      tuple((step, r, 0.01) for r in rs)))
                                   for rs in nodes])
                outcomes = [o for a in answers for o in a.reports]
                out[key] = open_s + time.perf_counter() - t0 + (plan_s if step == 10 else 0.0)
                assert outcomes.count("committed") == 1, outcomes
                for rep in reports:
                    sent.delivered(rep)
    finally:
        ray.shutdown()
    return out


def poll_rounds(sizes: list[int], actors: int = 8, rounds: int = 3, per_node: int = 8) -> dict[int, float]:
    """Seconds of one ``RayWorkerGroup.poll`` (the median of ``rounds``) over each of ``sizes``
    ranks, ``per_node`` to a node, served by ``actors`` real async Ray actors: every rank's
    pending ``run`` is a real Ray call, and each node's ``node_progress`` call (one per node) a
    real Ray call that reads its ranks' real progress files (``rank/progress.py``); a node's ranks
    share an actor, several nodes to an actor."""
    import statistics

    import ray

    from raytrain_ckpt.common.events import NodeProgress, Progress
    from raytrain_ckpt.control.group import RayWorkerGroup
    from raytrain_ckpt.rank.progress import ProgressFile, read_node

    spec = _spec()

    @ray.remote(num_cpus=0, max_concurrency=8192)
    class Ranks:
        async def run(self) -> None:
            await asyncio.sleep(3600)

        async def progress(self) -> Progress:
            return Progress(0, 10, None, time.time(), "training")

        def node_progress(self, ranks: list[int]) -> NodeProgress:
            return read_node(spec.name, 0, ranks)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        servers = [Ranks.remote() for _ in range(actors)]
        ray.get([s.progress.remote() for s in servers] + [s.node_progress.remote([]) for s in servers])
        out, answered = {}, {}
        for n in sizes:
            for r in range(n):  # what each rank's process writes at every change of its progress
                ProgressFile(spec.name, 0, r).show(Progress(r, 10, None, time.time(), "training"), 0)
            group = RayWorkerGroup(spec, 0)
            group.workers = [servers[(r // per_node) % actors] for r in range(n)]
            group.nodes = [f"node-{r // per_node}" for r in range(n)]
            group._runs = {group.workers[r].run.remote(): r for r in range(n)}
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                poll = group.poll()
                times.append(time.perf_counter() - t0)
                assert not poll.failures and (poll.min_step == 10 or len(poll.phases) < n), poll
                answered.setdefault(n, []).append(len(poll.phases))
            out[n] = statistics.median(times)
            if min(answered[n]) < n:  # a round that ended at the poll's timeout is not a full round
                print(f"N={n}: only {min(answered[n])} of {n} ranks answered within the poll's timeout in "
                      f"some round", file=sys.stderr)
            for ref in group._runs:
                ray.cancel(ref)
        return out
    finally:
        ray.shutdown()


COLUMNS = [("plan_s", "plan+metadata s", "{:.3f}"), ("global_plan_s", "global plan s", "{:.3f}"),
           ("dcp_global_plan_s", "DCP global plan s", "{:.3f}"),
           ("metadata_mb", ".metadata MB", "{:.2f}"), ("first_commit_s", "1st commit s", "{:.3f}"),
           ("first_save_s", "1st save s", "{:.3f}"), ("commit_s", "commit s", "{:.3f}"),
           ("save_s", "save s", "{:.3f}"), ("changed_commit_s", "changed commit s", "{:.3f}"),
           ("changed_save_s", "changed save s", "{:.3f}"),
           ("last_build_commit_s", "bytes-last build commit s", "{:.3f}"),
           ("last_build_save_s", "bytes-last build save s", "{:.3f}"),
           ("spliced_commit_s", "spliced commit s", "{:.3f}"), ("spliced_save_s", "spliced save s", "{:.3f}"),
           ("writer_digest_ms", "writer digest ms", "{:.1f}"),
           ("calls", "calls/save", "{:d}"),
           ("mb", "MB in/save", "{:.1f}"), ("changed_mb", "MB in changed", "{:.1f}"),
           ("first_mb", "MB in 1st", "{:.1f}"), ("peak_mb", "peak MB", "{:.0f}"),
           ("resume_check_s", "check after commit s", "{:.3f}"), ("resume_s", "resume plan s", "{:.3f}"),
           ("resume_cold_s", "resume plan cold s", "{:.3f}"), ("ls_status_s", "ls/status cold s", "{:.3f}"),
           ("resume_again_s", "resume again s", "{:.3f}"), ("ls_status_again_s", "ls/status again s", "{:.3f}"),
           ("resume_next_check_s", "next check s", "{:.3f}"), ("resume_next_s", "resume after next save s", "{:.3f}"),
           ("fresh_actor_cold_s", "fresh actor + plan cold s", "{:.3f}"),
           ("fresh_actor_sealed_s", "fresh actor + plan sealed s", "{:.3f}"),
           ("rank_read_cold_s", "rank .metadata read cold s", "{:.3f}"),
           ("rank_read_vouched_s", "rank .metadata read vouched s", "{:.3f}"),
           ("plans_mb", "RSS w/ plans MB", "{:.0f}"),
           ("poll_s", "poll s", "{:.3f}"), ("ray_first_save_s", "Ray actor 1st save s", "{:.3f}"),
           ("ray_save_s", "Ray actor save s", "{:.3f}")]
RAY_MAX_N = 64
"""The largest N ``--ray`` drives through a Ray actor (the calls of larger N take this box's two cores for long)."""


def _cell(row: dict[str, Any], key: str, form: str) -> str:
    if key in row:
        return form.format(row[key])
    return f"> {DCP_CAP_S:g} (cap)" if key in row.get("capped", ()) else "-"


def _table(rows: list[dict[str, Any]]) -> None:
    cols = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    print(f"{'model':>5} {'N':>5} {'items':>9} " + " ".join(f"{h:>17}" for _, h, _ in cols))
    for r in rows:
        print(f"{r['model']:>5} {r['n']:>5} {r['items']:>9} "
              + " ".join(f"{_cell(r, k, f):>17}" for k, _, f in cols))
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["n"])
        if len(mine) < 2:
            continue
        a, b = mine[-2], mine[-1]
        slopes = []
        for k, h, _ in cols:
            if k in a and k in b and a[k] > 0 and b[k] > 0:
                slopes.append(f"{h} {math.log(b[k] / a[k]) / math.log(b['n'] / a['n']):.2f}")
        print(f"{model} growth exponent, N {a['n']} -> {b['n']} (1.00 = linear; items "
              f"{math.log(b['items'] / a['items']) / math.log(b['n'] / a['n']):.2f}): " + ", ".join(slopes))


def _prefix_lines(r: dict[str, Any]) -> list[str]:
    out = [f"{r['bytes'] / 1e9:.0f} GB a save, files of {r['file_mb']:.0f} MB: {r['requests']} write requests "
           f"under the step's prefix, {r['prefix_s']:.1f} s of one prefix's {S3_PUTS_PER_PREFIX_S}/s"]
    for scheme in ("flat", "spread"):
        counts = dict(sorted(r[scheme].items(), key=lambda kv: -kv[1]))
        top = max(counts.values())
        where = "step-N/__" if scheme == "flat" else "step-N/"
        out.append(f"    {scheme:>6} names, requests per key range (first character after {where}; "
                   f"{len(counts)} of them, the busiest {top}: {top / S3_PUTS_PER_PREFIX_S:.2f} s of "
                   f"{S3_PUTS_PER_PREFIX_S}/s): " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return out


def _wire_lines(r: dict[str, Any]) -> list[str]:
    return [f"{r['items']} local-plan items, {r['mb']:.0f} MB into the actor ({r['planner_mb']:.0f} MB of it "
            f"planner data); a rank pickles its plan in {r['rank_encode_s']:.3f} s, the actor unpickles them all "
            f"in {r['actor_decode_s']:.1f} s",
            f"    as differences from rank 0's plan: {r['delta_mb']:.1f} MB into the actor; a rank makes and pickles "
            f"its own in {r['delta_encode_s']:.3f} s, the actor unpickles them all in {r['delta_decode_s']:.2f} s",
            f"    held by the actor until the plan: {r['held_mb']:.0f} MB as unpickled; {r['held_shared_mb']:.0f} MB with "
            f"the items and planner data equal on every rank held once"]


def _check_lines(r: dict[str, Any]) -> list[str]:
    dcp = f"{r['dcp_check_s']:.2f} s" if "dcp_check_s" in r else f"> {DCP_CAP_S:g} s (cap)"
    wide = f"{r['wide_dcp_check_s']:.3f} s" if "wide_dcp_check_s" in r else f"> {DCP_CAP_S:g} s (cap)"
    return [f"{r['tensors']} sharded tensors, {r['chunks']} chunks: plan check {r['check_s']:.2f} s, DCP's {dcp}; "
            f"one wide tensor ({r.get('wide_tensors', 0)} of them) {r.get('wide_check_s', 0):.3f} s, DCP's {wide}"]


def main() -> None:
    global PER_NODE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--models", nargs="+", default=["8b", "70b"], choices=sorted(MODELS))
    ap.add_argument("--poll", action="store_true", help="also one controller poll round per N (starts Ray)")
    ap.add_argument("--poll-only", action="store_true", help="only the controller poll round per N")
    ap.add_argument("--ray", action="store_true",
                    help=f"also the two saves through the actor as a Ray actor (N <= {RAY_MAX_N}); with --calls-only, "
                         "a later save's calls timed through one, the debug model's plan, any N")
    ap.add_argument("--prefixes", action="store_true",
                    help="only the object-store write requests per save under the step's prefix, per model and N, "
                         "and per first key character after it (DCP's names and the spread ones)")
    ap.add_argument("--check-only", action="store_true",
                    help="only the first save's global-plan check (ours and DCP's) per model and N")
    ap.add_argument("--wire", action="store_true",
                    help="only the first save's local plans on the wire: pickled by each rank, unpickled by the actor")
    ap.add_argument("--numbers", action="store_true",
                    help="only the first save's global plan computed on the ranks' plans as numbers")
    ap.add_argument("--commit", action="store_true",
                    help="with --numbers: the first commit's .metadata built from every rank's write results too")
    ap.add_argument("--per-node", type=int, default=PER_NODE,
                    help=f"ranks per node, whose writer carries their calls into the actor (default {PER_NODE})")
    ap.add_argument("--calls-only", action="store_true",
                    help="only the calls and bytes into the actor of a later save, per rank and per node, per N")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    PER_NODE = args.per_node
    if args.calls_only:
        for n in args.sizes:
            r = calls_row(n)
            print(f"N={n:>5}: a later save's calls into the actor: {r['rank_calls']} ({r['rank_mb']:.2f} MB) made "
                  f"per rank, {r['node_calls']} ({r['node_mb']:.2f} MB) with a node's writer carrying its "
                  f"{PER_NODE} ranks' hand-offs, reports and stalls", flush=True)
            if args.ray:  # the calls timed through a real Ray actor, the debug model's plan (see calls_timed)
                for per_node, seconds in calls_timed(n, (1, PER_NODE)).items():
                    print(f"    through a Ray actor, {per_node} rank(s) a node: a later save's calls answered in "
                          f"{seconds:.3f}s", flush=True)
        return
    if args.one:
        row = one(args.one[0], int(args.one[1]))
        if args.ray and row["n"] <= RAY_MAX_N:
            row.update(ray_saves(args.one[0], row["n"]))
        print(json.dumps(row))
        return
    single = {"prefixes": (prefix_row, _prefix_lines), "wire": (wire_row, _wire_lines),
              "check_only": (check_row, _check_lines),
              "numbers": (lambda model, n: numbers_row(_spec(), model, n, args.commit), numbers_lines)}
    for mode, (row_of, lines_of) in single.items():
        if getattr(args, mode):
            for model in args.models:
                for n in args.sizes:
                    for line in lines_of(row_of(model, n)):
                        print(f"{model} N={n:>5}: {line}" if not line.startswith(" ") else line, flush=True)
            return
    if args.poll_only:
        for n, seconds in poll_rounds(args.sizes).items():
            print(f"N={n:>5}: one controller poll round {seconds:.3f}s")
        return
    rows = []
    for model in args.models:
        for n in args.sizes:
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, __file__, "--one", model, str(n), "--per-node", str(PER_NODE),
                                   *(["--ray"] if args.ray else [])],
                                  capture_output=True, text=True,
                                  # Each N reads its steps as for the first time: the saves of one plan write
                                  # the same .metadata bytes in every run, which the scan cache under the
                                  # user's cache directory would remember between runs.
                                  env={**os.environ, "PYTHONPATH": str(REPO), "RAYTRAIN_CKPT_SCAN_CACHE": "0"})
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{model} at {n} ranks failed")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"# {model} N={n}: {time.monotonic() - t0:.0f}s {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    if args.poll:
        polls = poll_rounds(args.sizes)
        for r in rows:
            r["poll_s"] = polls[r["n"]]
    _table(rows)


if __name__ == "__main__":
    main()
