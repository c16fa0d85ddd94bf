"""When a node's writer sends what its ranks queued (``roles/courier.py``): at once when every rank
of the node it knows of is in, after the window otherwise; a real CheckpointActor (a plain object
on its own event loop, as the Ray actor runs its async methods) answers each entry."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
import pytest

from raytrain_ckpt.checkpoint.errors import StepAborted
from raytrain_ckpt.checkpoint.records import GroupLayout, NodeBatch, RankReport
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.roles.courier import NodeCourier


def _courier(tmp_path: Path, world: int, window_s: float) -> tuple[NodeCourier, list[NodeBatch]]:
    actor = CheckpointActor(str(tmp_path), RetentionPolicy(None))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(actor.configure(GroupLayout(world, world, "h", None)), loop).result()
    sent: list[NodeBatch] = []

    def send(batch: NodeBatch):
        sent.append(batch)
        return asyncio.run_coroutine_threadsafe(actor.node_report(batch), loop).result()

    return NodeCourier(send, lambda: None, windows={"accepted": window_s}), sent


def test_a_node_whose_ranks_are_all_in_sends_at_once_else_after_the_window(tmp_path: Path) -> None:
    courier, sent = _courier(tmp_path, 4, window_s=3.0)
    for rank in range(4):
        courier.expect(0, rank)
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        tmps = list(pool.map(lambda r: courier.accepted(10, r, 0), range(4)))
    assert time.monotonic() - t0 < 2.0 and len(set(tmps)) == 1
    assert len(sent) == 1 and sorted(r for _, r, _ in sent[0].accepted) == [0, 1, 2, 3]
    # Three of the four: they wait out the window, then go together.
    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda r: courier.accepted(20, r, 0), range(3)))
    assert time.monotonic() - t0 >= 2.9
    assert len(sent) == 2 and sorted(r for _, r, _ in sent[1].accepted) == [0, 1, 2]
    # A new attempt forgets the old one's ranks: until they allocate again, the window applies.
    courier.expect(1, 0)
    t0 = time.monotonic()
    courier.accepted(30, 0, 1)
    assert time.monotonic() - t0 < 2.0  # rank 0 is the attempt's only rank known so far


def test_hand_offs_and_reports_queued_together_go_as_two_calls_the_hand_offs_first(tmp_path: Path) -> None:
    """A hand-off's call may be made again on a restarted actor (``node_accepted``), a report's
    never: what was queued of both kinds goes as two batches, the one without reports first."""
    courier, sent = _courier(tmp_path, 4, window_s=0.3)
    courier._windows["report"] = 0.3
    # No rank of the node is known (no ``expect``): both wait out their window, so they go together.
    report = RankReport(9, 1, 0, "0.9", [], {})
    with ThreadPoolExecutor(2) as pool:
        hand_off = pool.submit(courier.accepted, 10, 0, 0)
        reported = pool.submit(courier.report, report)
        assert Path(hand_off.result(timeout=10)).is_dir()
        with pytest.raises(StepAborted, match="step 9 is not in flight"):  # that caller alone sees it
            reported.result(timeout=10)
    assert [(len(b.accepted), len(b.reports)) for b in sent] == [(1, 0), (0, 1)]
