"""Rank 0 hosts the rendezvous before any rank joins: ``TrainWorker.address()`` returns the
address of a store that already accepts connections (a refused connection is retried by torch
only after a back-off of about half a second, which a restart would wait)."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist


def _worker():
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.worker import TrainWorker

    # Built without __init__: constructing a worker configures the process for a Ray actor.
    worker = object.__new__(TrainWorker)
    worker.spec, worker.rank, worker.world_size, worker._store = JobSpec(name="rdv"), 0, 2, None
    return worker


def _accepts(addr: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex((addr, port)) == 0


def test_the_address_rank_0_hands_out_is_already_listening():
    worker = _worker()
    meet = worker.address()
    addr, port = meet.host, meet.port
    assert _accepts(addr, port)  # listening before anyone joins: no refused connection, no back-off
    client = dist.TCPStore(addr, port, 2, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("k", "v")
    assert worker._store.get("k") == b"v"  # the store rank 0's init_process_group will use


def test_a_new_address_closes_the_previous_store():
    worker = _worker()
    meet = worker.address()
    addr, first = meet.host, meet.port
    second = worker.address().port
    assert second != first and _accepts(addr, second)
    with pytest.raises(OSError):
        socket.create_connection((addr, first), timeout=5).close()
