"""The CheckpointActor at many ranks keeps the commit protocol (real actor object, real DCP files).

``bench/scale.py`` drives the actor with simulated ranks (``bench/scale_ranks.py``); what it
made cheaper per call (each rank's progress published alone, the cached plan's metadata shared
rather than copied per commit, unchanged results sent as a digest and the last ``.metadata``
copied: ``roles/repeats.py``) must not weaken a guarantee: a step commits only when every rank
reported, one missing report leaves it uncommitted until ``settle`` aborts it, the progress
series say exactly what the full view says, and a copied ``.metadata`` is byte for byte the one
a full build writes.
"""

from __future__ import annotations

import asyncio
import os
import pickle
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from bench.scale_ranks import local_plan, template, write_results
from raytrain_ckpt.checkpoint.format.rankresults import RankResults
from raytrain_ckpt.checkpoint.format.plannumbers import own_central
from raytrain_ckpt.observe import metrics
from raytrain_ckpt.checkpoint.errors import StepAborted
from raytrain_ckpt.checkpoint.format.metadata import read_metadata
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.records import CentralPlan, GroupLayout, RankReport, StepPhase
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.roles.repeats import RESEND, SentResults
from raytrain_ckpt.models.config import PRESETS
from raytrain_ckpt.control.preflight import load_spec

N = 32


@pytest.fixture(scope="module")
def plans() -> list:
    spec = load_spec("jobs/llama_debug_fsdp.yaml", [])
    shape = template(spec, PRESETS["debug"])
    return [local_plan(shape, r, N) for r in range(N)]


def _gauge(name: str, **tags: str) -> float:
    """The value the actor last set on gauge ``name`` with ``tags``."""
    return metrics._gauges[(name, tuple(sorted(tags.items())))]


async def _hand_off(actor: CheckpointActor, step: int, centrals: list, skip: set[int],
                    sent: SentResults | None = None, attempt: int = 0) -> tuple[str, list[str]]:
    """Every rank hands ``step`` off; every rank not in ``skip`` reports its files (sparse, real),
    through ``sent`` as the writers do when given (unchanged results go as a digest).
    Returns the step's temporary directory and the reports' outcomes."""
    tmp = await actor.open_step(step, attempt)
    outcomes = []
    for rank in range(N):
        await actor.accepted(step, rank, attempt, None)
    for rank in range(N):
        if rank in skip:
            continue
        report = _written(tmp, centrals[rank], rank, step, attempt)
        if sent is not None:
            report = sent.slim(report)
        outcomes.append(await actor.report(report))
        if sent is not None:
            sent.delivered(report)
    return tmp, outcomes


def _made(centrals: list, plans: list) -> list:
    """Each rank's central plan made from its own local plan, as the rank makes it."""
    return [CentralPlan(own_central(c.plan, plans[r]), c.plan_id) for r, c in enumerate(centrals)]


def _written(tmp: str, central, rank: int, step: int, attempt: int = 0) -> RankReport:
    """Rank ``rank``'s file of ``step`` in ``tmp`` (sparse, of the size its results name) and the
    report its writer sends for it."""
    results = write_results(central.plan, step)
    name = results[0].storage_data.relative_path
    size = results[-1].storage_data.offset + results[-1].storage_data.length
    with open(os.path.join(tmp, name), "wb") as f:
        f.truncate(size)
    return RankReport(step, rank, attempt, central.plan_id, RankResults.of(results), {name: {"size": size, "crc32c": 0}})


def test_one_missing_report_of_many_ranks_still_aborts_the_step(tmp_path: Path, plans: list) -> None:
    actor = CheckpointActor(str(tmp_path), RetentionPolicy(None))
    asyncio.run(actor.configure(GroupLayout(N, N, "h", None)))
    job = actor.layout.name

    sent = SentResults()

    async def scenario() -> None:
        centrals = _made(await asyncio.gather(*(actor.plan(0, 10, r, plans[r], 30) for r in range(N))), plans)
        assert (await _hand_off(actor, 10, centrals, set(), sent))[1] == ["pending"] * (N - 1) + ["committed"]
        # The next save of the attempt reuses the plan and its results: every writer sends a
        # digest alone; rank 17's report never comes.
        assert all(_digest_only(sent, r, centrals[r].plan_id, 20, centrals[r].plan) for r in range(N))
        tmp, outcomes = await _hand_off(actor, 20, centrals, {17}, sent)
        assert outcomes == ["pending"] * (N - 1)
        assert actor.steps.phase_of(20) is StepPhase.WRITING
        # The per-rank series, published one rank at a time, equal the full view.
        view = actor.steps.inflight([])
        assert view.step == 20 and view.ranks[17] == 1 and sum(v == 2 for v in view.ranks.values()) == N - 1
        for rank in range(N):
            assert _gauge("checkpoint_rank_progress", job=job, rank=str(rank)) == view.ranks[rank], rank
        assert _gauge("checkpoint_inflight_ranks", job=job, stage="written") == N - 1
        assert _gauge("checkpoint_inflight_phase", job=job, phase="writing") == 1
        with pytest.raises(asyncio.TimeoutError):
            await actor.wait_committed(20, 0.2)
        await actor.settle(0.5)
        with pytest.raises(StepAborted):
            await actor.wait_committed(20, 0.2)
        assert not Path(tmp).exists()

    asyncio.run(scenario())
    assert sorted(actor.committed) == [10]
    assert actor.steps.failed[20].startswith("not committed within")
    # The committed step's .metadata holds every rank's items, read back as DCP reads it.
    meta = pickle.loads((actor.layout.step_dir(10) / ".metadata").read_bytes())
    assert len(meta.storage_data) == len({i.index for p in plans for i in p.items})


def _digest_only(sent: SentResults, rank: int, plan_id: str, step: int, central) -> bool:
    """Whether the writer side would send rank ``rank``'s results of ``step`` as a digest alone."""
    results = write_results(central, step)
    return sent.slim(RankReport(step, rank, 0, plan_id, RankResults.of(results))).results is None


def _saves(root: Path, plans: list, steps: list[int], reuse: bool) -> CheckpointActor:
    """An actor that plans at the first of ``steps`` and commits each of them from every rank
    (``reuse=False``: its cache of earlier ``.metadata`` is emptied before each commit)."""
    actor = CheckpointActor(str(root), RetentionPolicy(None))
    asyncio.run(actor.configure(GroupLayout(N, N, "h", None)))
    sent = SentResults()

    async def scenario() -> None:
        centrals = _made(await asyncio.gather(*(actor.plan(0, steps[0], r, plans[r], 30) for r in range(N))), plans)
        for step in steps:
            if not reuse:
                actor.coordinator.repeats.built.clear()
            assert (await _hand_off(actor, step, centrals, set(), sent))[1][-1] == "committed"

    asyncio.run(scenario())
    return actor


def test_unchanged_results_go_as_digests_and_reuse_the_metadata_byte_for_byte(tmp_path: Path, plans: list) -> None:
    cached = _saves(tmp_path / "cached", plans, [10, 20], reuse=True)
    built = _saves(tmp_path / "built", plans, [10, 20], reuse=False)
    assert (cached.coordinator.repeats.reused, cached.coordinator.repeats.rebuilt) == (1, 1)
    assert (built.coordinator.repeats.reused, built.coordinator.repeats.rebuilt) == (0, 2)
    copied = (cached.layout.step_dir(20) / ".metadata").read_bytes()
    assert copied == (built.layout.step_dir(20) / ".metadata").read_bytes()
    assert copied == (cached.layout.step_dir(10) / ".metadata").read_bytes()
    # A separate file (not a link): damaging one step's .metadata leaves the older step's intact.
    assert os.stat(cached.layout.step_dir(20) / ".metadata").st_ino != os.stat(cached.layout.step_dir(10) / ".metadata").st_ino
    assert cached.committed[20].files[".metadata"] == built.committed[20].files[".metadata"]
    # Both load back as DCP reads them, with every rank's items.
    meta = read_metadata(cached.layout.step_dir(20))
    assert len(meta.storage_data) == len({i.index for p in plans for i in p.items})


def test_changed_results_or_a_new_plan_rebuild_the_metadata(tmp_path: Path, plans: list) -> None:
    # Step 100's byte items are a byte longer (a counter gained a digit): every offset after them moves.
    actor = _saves(tmp_path, plans, [10, 20, 100], reuse=True)
    assert (actor.coordinator.repeats.reused, actor.coordinator.repeats.rebuilt) == (1, 2)
    old, new = read_metadata(actor.layout.step_dir(20)), read_metadata(actor.layout.step_dir(100))
    assert old.storage_data != new.storage_data
    byte_items = [i for i in new.storage_data if isinstance(new.state_dict_metadata[i.fqn], BytesStorageMetadata)]
    assert byte_items and {new.storage_data[i].length for i in byte_items} == {64 + len("100")}
    assert {old.storage_data[i].length for i in byte_items} == {64 + len("20")}
    # A new attempt plans again (another layout may come with it): its first save builds in full,
    # and a writer's digest of the old plan is not taken for the new one.
    sent = SentResults()

    async def next_attempt() -> None:
        centrals = _made(await asyncio.gather(*(actor.plan(1, 110, r, plans[r], 30) for r in range(N))), plans)
        assert centrals[0].plan_id != "0.10"
        assert (await _hand_off(actor, 110, centrals, set(), sent, attempt=1))[1][-1] == "committed"
        assert all(_digest_only(sent, r, centrals[r].plan_id, 110, centrals[r].plan) for r in range(N))
        assert not _digest_only(sent, 0, "0.10", 110, centrals[0].plan)

    asyncio.run(next_attempt())
    assert (actor.coordinator.repeats.reused, actor.coordinator.repeats.rebuilt) == (1, 3)
    assert read_metadata(actor.layout.step_dir(110)).storage_data == new.storage_data


def test_a_digest_the_actor_does_not_hold_is_sent_again_in_full(tmp_path: Path, plans: list) -> None:
    actor = CheckpointActor(str(tmp_path), RetentionPolicy(None))
    asyncio.run(actor.configure(GroupLayout(N, N, "h", None)))

    async def scenario() -> None:
        centrals = _made(await asyncio.gather(*(actor.plan(0, 10, r, plans[r], 30) for r in range(N))), plans)
        await actor.open_step(10, 0)
        # A report by digest with no earlier full report (as from a writer that outlived an actor's
        # state): answered RESEND, the step still in flight, nothing recorded for the rank.
        assert await actor.report(RankReport(10, 3, 0, centrals[3].plan_id, None, {}, digest="0" * 32)) == RESEND
        assert actor.steps.phase_of(10) is not StepPhase.ABORTED and 10 not in actor.steps.failed
        assert 3 not in actor.steps.in_flight(10).reports

    asyncio.run(scenario())


def _report_all(actor: CheckpointActor, step: int, centrals: list, sent: SentResults, answers: list[str]) -> None:
    """Every rank hands ``step`` off and its writer reports through ``sent.send``, as a writer
    does (from its own thread, the actor's loop serving); ``answers`` gets each call's answer."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        def call(report: RankReport) -> str:
            out = asyncio.run_coroutine_threadsafe(actor.report(report), loop).result()
            answers.append(out)
            return out

        tmp = await actor.open_step(step, 0)
        for rank in range(N):
            await actor.accepted(step, rank, 0, None)
        for rank in range(N):
            await asyncio.to_thread(sent.send, _written(tmp, centrals[rank], rank, step), call)

    asyncio.run(scenario())


def test_a_save_in_flight_through_a_restart_of_the_actor_commits(tmp_path: Path, plans: list) -> None:
    """The ranks plan once and keep their plan; the CheckpointActor restarts (a drain of its node
    moves it) between two saves. The restarted actor reads the plan back from the newest committed
    step of it, takes every writer's report again in full, and commits the step."""
    first = CheckpointActor(str(tmp_path), RetentionPolicy(None))
    asyncio.run(first.configure(GroupLayout(N, N, "h", None)))
    sent, answers = SentResults(), []

    async def planned() -> list:
        return _made(await asyncio.gather(*(first.plan(0, 10, r, plans[r], 30) for r in range(N))), plans)

    centrals = asyncio.run(planned())
    _report_all(first, 10, centrals, sent, answers)
    assert sorted(first.committed) == [10] and answers.count("committed") == 1
    # Restarted: a new actor on the same root, as Ray restarts it (nothing of the first one's memory).
    again = CheckpointActor(str(tmp_path), RetentionPolicy(None))
    assert again.coordinator._metadata == {}
    answers.clear()
    _report_all(again, 20, centrals, sent, answers)  # the writers hold digests the new actor never saw
    assert sorted(again.committed) == [10, 20], again.steps.failed
    assert answers.count(RESEND) == N and answers.count("committed") == 1
    # The step is what a full build of its reports makes: every rank's items, as DCP reads them.
    old, new = read_metadata(again.layout.step_dir(10)), read_metadata(again.layout.step_dir(20))
    assert new.storage_data == old.storage_data and len(new.storage_data) == len({i.index for p in plans for i in p.items})
    assert new.state_dict_metadata == old.state_dict_metadata
    # Later saves of the plan go back to digests and a copied .metadata.
    answers.clear()
    _report_all(again, 30, centrals, sent, answers)
    assert RESEND not in answers and again.coordinator.repeats.reused == 1


def test_a_restarted_actor_aborts_a_plan_no_committed_step_has(tmp_path: Path, plans: list) -> None:
    first = CheckpointActor(str(tmp_path), RetentionPolicy(None))
    asyncio.run(first.configure(GroupLayout(N, N, "h", None)))

    async def planned() -> list:
        return _made(await asyncio.gather(*(first.plan(0, 10, r, plans[r], 30) for r in range(N))), plans)

    centrals = asyncio.run(planned())
    again = CheckpointActor(str(tmp_path), RetentionPolicy(None))   # restarted before step 10 committed

    async def report() -> None:
        await again.open_step(10, 0)
        results = write_results(centrals[0].plan, 10)
        with pytest.raises(StepAborted, match="unknown"):
            await again.report(RankReport(10, 0, 0, centrals[0].plan_id, RankResults.of(results), {}))

    asyncio.run(report())
    assert again.steps.failed[10] == "plan unknown after a checkpoint actor restart"


def test_a_gather_outlives_neither_its_ranks_nor_a_failed_plan(tmp_path: Path, plans: list) -> None:
    """Every rank's local plan and central plan are O(ranks x tensors): once every rank took its
    central plan, or the last rank waiting for an incomplete gather gave up (its attempt's ranks
    died), the coordinator holds neither, and no step stays ``planning`` in the status. The plans
    sent back carry no planner data (it is in the metadata the coordinator keeps)."""
    actor = CheckpointActor(str(tmp_path / "job"), RetentionPolicy(None))
    asyncio.run(actor.configure(GroupLayout(N, N, "h", None)))
    coordinator = actor.coordinator

    async def scenario() -> None:
        # attempt 0: two ranks arrive, the rest died; both give up
        waiting = [actor.plan(0, 10, r, plans[r], 0.2) for r in (0, 1)]
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(o, StepAborted) and "only ranks [0, 1] of 32" in str(o) for o in outcomes), outcomes
        assert coordinator._gathers == {} and coordinator.planning() == []
        # attempt 1: every rank plans; each takes its plan and the gather is gone
        centrals = _made(await asyncio.gather(*(actor.plan(1, 20, r, plans[r], 30) for r in range(N))), plans)
        assert coordinator._gathers == {} and coordinator.planning() == []
        assert all(c.plan.planner_data is None for c in centrals)
        assert coordinator._metadata[centrals[0].plan_id].planner_data  # the flattened keys' paths, kept once
        _, outcomes = await _hand_off(actor, 20, centrals, set(), attempt=1)
        assert outcomes[-1] == "committed"

    asyncio.run(scenario())
    assert sorted(actor.layout.valid_steps("size")) == [20]


def test_the_benchmarks_first_commit_is_a_metadata_the_reader_accepts() -> None:
    """``bench/scale.py --numbers --commit`` times the first commit's ``.metadata`` from results it
    makes up per rank: they must be a real layout (every chunk stored once, in its rank's file, its
    bytes where the file has them), or the figure measures nothing a save builds."""
    import io

    from bench.scale import _spec
    from bench.scale_numbers import numbers_row, rank_numbers
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    from raytrain_ckpt.checkpoint.format.chunks import layout_problem
    from raytrain_ckpt.checkpoint.format.metadata import load_metadata
    from raytrain_ckpt.checkpoint.format.metarows import PlanArrays, from_ranks
    from raytrain_ckpt.checkpoint.roles.planning import GatheredPlans
    from raytrain_ckpt.checkpoint.format.plannumbers import SharedPlan, difference_from

    n = 4
    shape = template(_spec(), PRESETS["debug"])
    local = [local_plan(shape, r, n) for r in range(n)]
    gathered = GatheredPlans()
    for r in range(n):
        gathered.add(r, SharedPlan(local[0]) if r == 0 else difference_from(local[0], local[r], 0))
    _, metadata = gathered.build(n, spread=False)
    results = rank_numbers(metadata, n)
    entries = sum(len(v.chunks) if hasattr(v, "chunks") else 1 for v in metadata.state_dict_metadata.values())
    assert all(len(r) for r in results) and sum(map(len, results)) == entries   # a result per chunk and per byte item
    data = from_ranks(PlanArrays.of(metadata), results, None, CURRENT_DCP_VERSION).data
    read = load_metadata(io.BytesIO(data), ".metadata")
    assert len(read.storage_data) == entries
    sizes = {f"__{r}_0.distcp": int(results[r].where[:, 2].sum()) for r in range(n)}
    assert layout_problem(read, sizes) is None
    assert layout_problem(read, {name: size // 2 for name, size in sizes.items()}) is not None  # bytes past the end
    row = numbers_row(_spec(), "8b", n, commit=True)
    assert row["metadata_mb"] > 0 and row["build_s"] > 0 and row["results_in_s"] > 0 and row["splice_s"] > 0
