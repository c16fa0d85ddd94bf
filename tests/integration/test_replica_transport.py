"""Peer replicas between real CheckpointWriter actors (session Ray): a writer sends a committed
copy to its peer through Ray in paced chunks, the peer holds a verified file of its own, a
second writer (a replacement node's) can be given the replica, and the replicas go with
``release_all``; a sender killed mid-send leaves nothing half-received visible."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.datapath.buffers import shm_dir

pytestmark = pytest.mark.integration


def _copy_type():
    # Defined in a function so Ray pickles it by value (the test module is not importable in actors).
    @dataclasses.dataclass(frozen=True)
    class Copy:
        step: int
        rank: int
        nbytes: int
        path: str
        objects: bytes = b""

    return Copy


def _writer(ray, job: str, rate: float | None = None):
    from raytrain_ckpt.checkpoint.roles.writer import CheckpointWriter

    return ray.remote(CheckpointWriter).options(num_cpus=0, max_concurrency=16).remote(
        job, f"/tmp/{job}", None, replica_mb_per_s=rate)


def _source(tmp: Path, rank: int, step: int, nbytes: int):
    from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer

    buf = OwnedBuffer.create(tmp / f"rtc-test-src-rank{rank}-step{step}.buf", nbytes)
    data = os.urandom(nbytes)
    fd = os.open(buf.path, os.O_RDWR)
    os.pwrite(fd, data, 0)
    os.close(fd)
    return _copy_type()(step, rank, nbytes, str(buf.path), b"objects"), buf, data


def test_replica_goes_to_the_peer_and_on_to_a_replacement(ray_cluster, tmp_path):
    ray = ray_cluster
    node = ray.get_runtime_context().get_node_id()
    a, b, c = (_writer(ray, f"rep-{x}-{os.getpid()}") for x in "abc")
    copy, src, data = _source(tmp_path, 1, 10, 20 << 20)  # 20 MB: three chunks
    assert ray.get(a.replicate.remote(copy, wait=True)) is None            # no peer yet: nothing sent
    ray.get(a.set_peer.remote(node, b))
    held = ray.get(a.replicate.remote(copy, wait=True))
    assert (held.rank, held.step, held.source_node, held.copy.objects) == (1, 10, node, b"objects")
    assert held.path != copy.path and Path(held.path).read_bytes() == data
    assert ray.get(b.replicas_held.remote()) == [held]

    # A newer step of the same rank replaces the replica; the older file is gone.
    newer, src2, data2 = _source(tmp_path, 1, 20, 3 << 20)
    held2 = ray.get(a.replicate.remote(newer, wait=True))
    assert ray.get(b.replicas_held.remote()) == [held2] and not Path(held.path).exists()

    # The rank is restored on another node: the holder passes the replica on, checked on both ends.
    moved = ray.get(b.push_replica.remote(1, 20, c, node))
    assert Path(moved.path).read_bytes() == data2 and moved.source_node == node
    with pytest.raises(ray.exceptions.RayTaskError, match="no verified copy of rank 1 step 10"):
        ray.get(b.push_replica.remote(1, 10, c, node))
    # b and c are on one node sharing shm_dir(), as nodes of a one-machine cluster do: no clash
    assert Path(moved.path) != Path(held2.path) and Path(held2.path).exists()

    ray.get([w.release_all.remote() for w in (b, c)])
    assert not Path(held2.path).exists() and not Path(moved.path).exists()
    for w in (a, b, c):
        ray.kill(w)
    src.remove(), src2.remove()


def test_a_sender_killed_mid_send_leaves_no_replica(ray_cluster, tmp_path):
    ray = ray_cluster
    node = ray.get_runtime_context().get_node_id()
    a, b = _writer(ray, f"rep-slow-{os.getpid()}", rate=4.0), _writer(ray, f"rep-peer-{os.getpid()}")
    ray.get(a.set_peer.remote(node, b))
    copy, src, _ = _source(tmp_path, 0, 5, 24 << 20)      # 24 MB at 4 MB/s: about 6 s
    a.replicate.remote(copy)
    deadline = time.monotonic() + 60
    while not list(shm_dir().glob(f"rtc-rep-peer-{os.getpid()}*-replica-rank0-step5.buf")):
        assert time.monotonic() < deadline, "the send never started"
        time.sleep(0.05)
    ray.kill(a)
    time.sleep(1.0)
    assert ray.get(b.replicas_held.remote()) == []           # half a replica is never held
    ray.get(b.release_all.remote())
    assert not list(shm_dir().glob(f"rtc-rep-peer-{os.getpid()}*"))
    ray.kill(b)
    src.remove()


def test_sends_and_failed_sends_reach_the_senders_metrics(ray_cluster, tmp_path, monkeypatch):
    """What a node's writer sent to its peer, and what it failed to send, is on its metrics
    (the dashboard's replica panel): the sender runs in this process to capture its records."""
    from raytrain_ckpt.observe import metrics
    from raytrain_ckpt.checkpoint.roles.writer import CheckpointWriter

    ray = ray_cluster
    recorded: list[tuple[str, float, str]] = []
    monkeypatch.setattr(metrics, "record", lambda name, value, tags: recorded.append((name, value, tags["rank"])))
    node = ray.get_runtime_context().get_node_id()
    sender = CheckpointWriter(f"rep-m-{os.getpid()}", f"/tmp/rep-m-{os.getpid()}", None, nice=0)
    peer = _writer(ray, f"rep-m-peer-{os.getpid()}")
    sender.set_peer(node, peer)
    copy, src, _ = _source(tmp_path, 1, 10, 3 << 20)
    assert sender.replicate(copy, wait=True) is not None
    sent = {name: value for name, value, rank in recorded if rank == "1"}
    assert sent["checkpoint_replica_step"] == 10 and sent["checkpoint_replica_bytes_total"] == 3 << 20
    assert sent["checkpoint_replica_seconds"] > 0 and "checkpoint_replica_failures_total" not in sent

    ray.get(peer.release_all.remote())
    ray.kill(peer)                                         # the peer node's writer is gone
    newer, src2, _ = _source(tmp_path, 1, 20, 1 << 20)
    assert sender.replicate(newer, wait=True) is None      # the send fails, and says so
    assert ("checkpoint_replica_failures_total", 1, "1") in recorded
    assert [value for name, value, _ in recorded if name == "checkpoint_replica_step"] == [10]
    src.remove(), src2.remove()
