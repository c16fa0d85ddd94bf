"""The membership rule (``replicas/membership.py``), the heals' meeting point (``replicas/roster.py``)
and which failures end one replica group only (``control/watch/replicas.py``): pure, table-tested."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raytrain_ckpt.common.events import Failure
from raytrain_ckpt.control.poll import GroupPoll
from raytrain_ckpt.control.watch.replicas import ReplicaHeals
from raytrain_ckpt.replicas.membership import Membership
from raytrain_ckpt.replicas.roster import Roster


def test_a_group_missing_at_a_step_is_out_for_heal_steps_and_back_after_its_heal_step():
    m = Membership(replicas=3, heal_steps=4)
    assert m.judge(1, {0, 1, 2}) is None and m.committed(1, {0, 1, 2}) == []
    assert m.judge(2, {0, 2}) is None  # group 1 failed: out of 2 .. 6, healed at 6
    assert m.committed(2, {0, 2}) == [1]
    assert m.expected(5) == {0, 2} and m.expected(6) == {0, 1, 2} and m.rejoining(6) == [1]
    for step in (3, 4, 5):
        assert m.judge(step, {0, 2}) is None and m.committed(step, {0, 2}) == [1]
    assert m.judge(6, {0, 1, 2}) is None
    assert m.committed(6, {0, 1, 2}) == [1]  # its heal step: healed, its share still skipped
    assert m.judge(7, {0, 1, 2}) is None and m.committed(7, {0, 1, 2}) == []
    assert m.skipped == [(s, 1) for s in range(2, 7)] and m.back == {}


@pytest.mark.parametrize("present, why", [
    ({0, 1}, "joined before their rejoin step"),  # came back early: never committed
])
def test_a_quorum_that_is_not_the_rules_is_redone(present, why):
    m = Membership(replicas=2, heal_steps=3)
    m.judge(1, {0, 1})
    m.judge(2, {0})
    assert why in (m.judge(3, present) or "")
    assert m.back == {1: 5}


def test_a_group_late_for_its_rejoin_step_or_the_first_step_is_waited_for_not_failed():
    m = Membership(replicas=2, heal_steps=3)
    assert "not in its quorum yet" in (m.judge(1, {0}) or "")  # the attempt's first step: late, not failed
    assert m.back == {}
    m.judge(1, {0, 1})
    m.committed(1, {0, 1})
    m.judge(2, {0})
    m.committed(2, {0})
    assert "not in its quorum yet" in (m.judge(5, {0}) or "")  # its rejoin step: the step is redone
    assert m.back == {1: 5}


def test_a_replacement_takes_the_live_groups_record():
    live = Membership(replicas=2, heal_steps=2)
    live.judge(1, {0, 1})
    live.committed(1, {0, 1})
    live.judge(2, {0})
    live.committed(2, {0})
    live.committed(3, {0})
    new = Membership(replicas=2, heal_steps=2)
    new.load(live.state(), 4)
    assert new.committed(4, {0, 1}) == live.committed(4, {0, 1}) == [1]
    assert new.skipped == live.skipped == [(2, 1), (3, 1), (4, 1)] and new.back == live.back == {}


def test_the_roster_meets_healthy_groups_and_a_replacement_at_the_rejoin_step():
    r = Roster()
    assert r.rejoin_step(1) is None
    r.wait_at(1, 9)
    r.ready(1, 0)
    assert r.rejoin_step(1) == 9 and not r.is_ready(1, 2)
    r.replacing(1)  # a second failure while it healed: the next replacement's ranks must say ready again
    r.ready(1, 0)
    r.ready(1, 1)
    assert r.is_ready(1, 2) and r.healing() == {1: 9}
    r.rejoined(1)
    assert r.healing() == {} and not r.is_ready(1, 2)


def _spec(replicas: int = 3, size: int = 2, min_replicas: int = 1, checkpoint: bool = True):
    return SimpleNamespace(parallelism=SimpleNamespace(dp_replicate=replicas), world_size=replicas * size,
                           fault_tolerance=SimpleNamespace(min_replicas=min_replicas, heal_steps=5),
                           training=SimpleNamespace(steps=30), checkpoint=SimpleNamespace(enabled=checkpoint))


def _failure(*failures: tuple[str, int | None]) -> Failure:
    (kind, rank), *after = failures
    return Failure(0, kind, rank, f"{kind} {rank}", after=tuple(Failure(0, k, r, f"{k} {r}") for k, r in after))


@pytest.mark.parametrize("spec, failures, healing, step, replica", [
    (_spec(), [("crash", 3)], set(), 0, 1),  # one rank of group 1
    (_spec(), [("crash", 4), ("exception", 5)], set(), 0, 2),  # a crash and its echo in the same group
    (_spec(), [("rollback", 2)], set(), 0, 1),  # a guard trip: the group's state is replaced by a live one
    (_spec(), [("hang", 5)], set(), 0, 2),  # a hang whose culprit is one rank
    (_spec(), [("crash", 1)], set(), 10, 0),  # group 0 saves: its replacement saves from its rejoin step (16)
    (_spec(), [("crash", 1)], set(), 22, 0),  # ... which is before the last step, to save it
    (_spec(), [("crash", 1)], set(), 23, None),  # too close to the end to save it: the whole job restarts
    (_spec(checkpoint=False), [("crash", 1)], set(), 29, 0),  # nothing to save: as any other group
    (_spec(), [("crash", 3)], set(), 29, 1),  # a group that does not save is not waited for
    (_spec(), [("crash", 2), ("crash", 4)], set(), 0, None),  # two groups at once
    (_spec(), [("hang", None)], set(), 0, None),  # no culprit
    (_spec(), [("start", None)], set(), 0, None),
    (_spec(), [("mismatch", 3)], set(), 0, None),  # not a failure a replacement changes
    (_spec(min_replicas=2), [("crash", 2)], {4, 5}, 0, None),  # group 2 heals already: 1 healthy < 2
    (_spec(min_replicas=2), [("crash", 2)], set(), 0, 1),
    (_spec(replicas=2, min_replicas=2), [("crash", 2)], set(), 0, None),
])
def test_which_failures_end_one_replica_group_only(spec, failures, healing, step, replica):
    watch = ReplicaHeals(spec)
    assert watch.local_replica(_failure(*failures), healing, step) == replica
    assert watch.status() == {"replica_heals": 0 if replica is None else 1, "replicas_healing": []}


def test_a_heal_is_timed_once_its_group_trains_again_and_status_names_the_groups_healing():
    watch = ReplicaHeals(_spec())
    assert watch.local_replica(_failure(("crash", 3)), set()) == 1
    watch.observe(GroupPoll(), SimpleNamespace(healing={2, 3}), 0)
    assert watch.status() == {"replica_heals": 1, "replicas_healing": [1]} and "healed_s" not in watch.records[0]
    watch.observe(GroupPoll(), SimpleNamespace(healing=set()), 0)
    assert watch.status()["replicas_healing"] == [] and watch.records[0]["healed_s"] >= 0


class _Moves(SimpleNamespace):
    """A worker group whose ``heal`` records the groups moved off a node."""

    def heal(self, replica: int, off_node: bool = False) -> None:
        self.moved.append((replica, off_node))


@pytest.mark.parametrize("ranks, healing, step, moved", [
    ((2, 3), set(), 0, [(1, True)]),        # a node of the second group's ranks
    ((0,), set(), 10, [(0, True)]),         # the first (saving) group's node, early enough
    ((0,), set(), 23, []),                  # ... too close to the end: the whole job saves and restarts
    ((0, 2), set(), 0, [(0, True), (1, True)]),  # ranks of two groups on the node: both move (three groups)
    ((2,), {4, 5}, 0, [(1, True)]),         # another group heals already: one healthy left, min_replicas 1
])
def test_a_drain_or_eviction_moves_the_groups_of_the_nodes_ranks(ranks, healing, step, moved):
    watch = ReplicaHeals(_spec())
    group = _Moves(healing=healing, moved=[])
    assert watch.move_off(group, "n1", ranks, 0, step, "eviction") is bool(moved)
    assert group.moved == moved
    assert [(h["replica"], h["kind"]) for h in watch.records] == [(g, "eviction") for g, _ in moved]


def test_a_poll_no_live_rank_answered_does_not_reopen_the_saving_groups_window():
    """The rule uses the highest step a poll saw: a later poll reading 0 (no answer) does not let
    the saving group fail near the end into a heal."""
    watch = ReplicaHeals(_spec())
    watch.observe(GroupPoll(min_step=24), SimpleNamespace(healing=set()), 0)
    assert watch.local_replica(_failure(("crash", 1)), set(), 0) is None
