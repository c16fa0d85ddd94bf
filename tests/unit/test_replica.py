"""Peer replicas (checkpoint/datapath/replica.py): the ring, the pacing, and a store that keeps only
verified, newest replicas. Real buffer files in a temp dir; the "peer" is called directly."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer
from raytrain_ckpt.checkpoint.datapath.replica import Pacer, ReplicaStore, ring_peers, send_replica
from raytrain_ckpt.checkpoint.errors import ReplicaError


@pytest.mark.parametrize("nodes, expected", [
    ([], {}),
    (["a"], {}),                                   # one node: replication is off
    (["a", "a"], {}),                              # one node hosting many ranks
    (["b", "a"], {"a": "b", "b": "a"}),
    (["c", "a", "b"], {"a": "b", "b": "c", "c": "a"}),
    (["a", "c", "a", "b", "c"], {"a": "b", "b": "c", "c": "a"}),
])
def test_ring_peers(nodes, expected):
    assert ring_peers(nodes) == expected


@pytest.mark.parametrize("nodes, lost", [(["a", "b", "c", "d"], "b"), (["a", "b", "c"], "c"), (["n1", "n2", "n3"], "n1")])
def test_ring_loses_only_the_pair_into_the_lost_node(nodes, lost):
    before, after = ring_peers(nodes), ring_peers([n for n in nodes if n != lost])
    moved = {n for n in after if after[n] != before[n]}
    assert moved == {n for n in before if before[n] == lost}   # only the node that sent to the lost one
    assert lost not in after and lost not in after.values()


def test_pacer_holds_the_rate():
    now = [0.0]
    slept = []
    pacer = Pacer(10.0, clock=lambda: now[0], sleep=lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    for _ in range(5):
        pacer.account(4_000_000)                   # 4 MB at 10 MB/s: 0.4 s each
    assert now[0] == pytest.approx(2.0) and len(slept) == 5
    assert Pacer(None, clock=lambda: 0.0, sleep=lambda s: pytest.fail("no limit sleeps")).account(10**9) == 0.0


@dataclass(frozen=True)
class Copy:
    step: int
    rank: int
    nbytes: int
    path: str
    slots: tuple = ()


def _copy(tmp: Path, rank: int, step: int, data: bytes) -> tuple[Copy, OwnedBuffer]:
    buf = OwnedBuffer.create(tmp / f"rtc-src-rank{rank}-step{step}.buf", len(data))
    fd = os.open(buf.path, os.O_RDWR)
    os.pwrite(fd, data, 0)
    os.close(fd)
    return Copy(step, rank, len(data), str(buf.path)), buf


def _send(store: ReplicaStore, copy: Copy, mangle=None, chunk=1000):
    def put(rank, step, offset, data):
        store.put(rank, step, offset, mangle(offset, data) if mangle else data)
    return send_replica(copy, lambda c: store.begin("node-a", c), put, store.finish, Pacer(None), chunk_bytes=chunk)


def test_replica_round_trip_keeps_only_the_newest_step(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    store = ReplicaStore(dst, "job-1")
    first, _ = _copy(src, 1, 10, os.urandom(4500))
    r10 = _send(store, first)
    assert (r10.step, r10.rank, r10.source_node) == (10, 1, "node-a")
    assert Path(r10.path).parent == dst and Path(r10.path).read_bytes() == Path(first.path).read_bytes()
    assert r10.copy.slots == () and r10.copy.path == r10.path  # the descriptor travels, the path is ours
    store.check(r10)
    second, _ = _copy(src, 1, 20, os.urandom(3000))
    r20 = _send(store, second)
    assert store.held() == [r20] and store.get(1, 20) == r20 and store.get(1, 10) is None
    assert not Path(r10.path).exists()              # the older replica of the rank is gone
    other, _ = _copy(src, 0, 20, b"x" * 10)
    _send(store, other)
    assert sorted(r.rank for r in store.held()) == [0, 1]
    with pytest.raises(ReplicaError, match="not newer"):
        _send(store, first)
    store.remove_all()
    assert list(dst.iterdir()) == []


def test_a_corrupted_transfer_is_never_held(tmp_path):
    store = ReplicaStore(tmp_path, "job")
    good, _ = _copy(tmp_path, 3, 5, os.urandom(2500))
    held = _send(store, good)
    bad, _ = _copy(tmp_path, 3, 6, os.urandom(2500))
    flip = lambda off, data: (bytes([data[0] ^ 1]) + data[1:]) if off == 1000 else data  # noqa: E731
    with pytest.raises(ReplicaError, match="CRC-32C"):
        _send(store, bad, mangle=flip)
    assert store.held() == [held]                   # the verified older one stays
    assert not any("step6" in p.name and "replica" in p.name for p in tmp_path.iterdir())


def test_out_of_order_chunk_fails_the_replica(tmp_path):
    store = ReplicaStore(tmp_path, "job")
    copy, _ = _copy(tmp_path, 0, 1, os.urandom(3000))
    store.begin("node-a", copy)
    store.put(0, 1, 0, b"a" * 1000)
    with pytest.raises(ReplicaError, match="does not follow"):
        store.put(0, 1, 2000, b"a" * 1000)
    with pytest.raises(ReplicaError, match="no replica is being received"):
        store.finish(0, 1, 0)
    assert store.held() == []


def test_a_held_replica_whose_bytes_rot_fails_the_check(tmp_path):
    store = ReplicaStore(tmp_path, "job")
    copy, _ = _copy(tmp_path, 0, 1, os.urandom(3000))
    held = _send(store, copy)
    fd = os.open(held.path, os.O_RDWR)
    os.pwrite(fd, b"\0\0\0\0", 100)
    os.close(fd)
    with pytest.raises(ReplicaError, match="recorded"):
        store.check(held)


def test_replication_spec():
    from raytrain_ckpt.spec import SpecError
    from raytrain_ckpt.control.preflight import load_spec

    spec = Path(__file__).resolve().parents[2] / "jobs" / "llama_debug_fsdp.yaml"
    assert load_spec(spec, []).checkpoint.replication.mode == "off"
    assert load_spec(spec, ["checkpoint.replication.mode=off"]).checkpoint.replication.mode == "off"  # YAML's False
    r = load_spec(spec, ["checkpoint.replication.mode=auto", "checkpoint.replication.max_mb_per_s=null"])
    assert (r.checkpoint.replication.mode, r.checkpoint.replication.max_mb_per_s) == ("auto", None)
    with pytest.raises(SpecError, match=r"checkpoint.replication.mode: auto needs memory_copies=2.*memory_copies=2"):
        load_spec(spec, ["checkpoint.replication.mode=auto", "checkpoint.memory_copies=1"])
    with pytest.raises(SpecError, match="max_mb_per_s"):
        load_spec(spec, ["checkpoint.replication.max_mb_per_s=0"])


def test_memory_estimate_counts_the_replica():
    from raytrain_ckpt.control.preflight import load_spec
    from raytrain_ckpt.spec.memory import memory_estimate

    spec = Path(__file__).resolve().parents[2] / "jobs" / "llama_debug_fsdp.yaml"
    off = memory_estimate(load_spec(spec, []))
    on = memory_estimate(load_spec(spec, ["checkpoint.replication.mode=auto"]))
    assert off.replica == 0 and not any("replica" in ln for ln in off.lines("cpu"))
    assert on.replica == on.staging // on.staging_copies > 0   # one more copy of the rank's state
    assert any(ln.strip().startswith("replica") for ln in on.lines("cpu"))
