"""The run lock on S3 (``leases.ObjectRunLock``): a conditional-write object that keeps a second
run of a job off its checkpoint root while the first renews it, lets go of a holder that died,
and tells a holder that was taken over. A real S3 endpoint (moto's server), real holder
processes killed with SIGKILL."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time

import pytest

from raytrain_ckpt.checkpoint.errors import RootInUse

from raytrain_ckpt.checkpoint.storage.runlock import ObjectRunLock, RUN_LOCK, run_lock
from raytrain_ckpt.checkpoint.storage.objects import object_filesystem
from tests.unit.test_staging_buffers import REPO

TTL = 3.0

HOLDER = """
import sys, time
from raytrain_ckpt.checkpoint.storage.runlock import run_lock
with run_lock(sys.argv[1], ttl_s=float(sys.argv[2]), beat_s=0.5):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(root: str) -> subprocess.Popen:
    """A driver-like process holding the run lock of ``root`` (the endpoint comes from the environment)."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, root, str(TTL)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _lock_body(root: str, options: dict) -> dict:
    return json.loads(object_filesystem(root, options).cat_file(f"{root}/{RUN_LOCK}"))


def test_a_second_run_is_refused_while_the_holder_renews_and_takes_over_once_it_died(s3_endpoint, s3_bucket):
    root = f"{s3_bucket}/runs/job"
    holder = _holder(root)
    try:
        with pytest.raises(RootInUse, match=rf"another run of this job is training into {root} \(pid {holder.pid} "):
            with run_lock(root, ttl_s=TTL):
                pass
        beat = _lock_body(root, s3_endpoint.options)["beat"]
        time.sleep(TTL + 1.0)                     # longer than the ttl: only the renewals keep it live
        assert _lock_body(root, s3_endpoint.options)["beat"] > beat
        with pytest.raises(RootInUse, match="renewed"):
            with run_lock(root, ttl_s=TTL):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    killed = time.monotonic()
    with pytest.raises(RootInUse, match="lets go"):  # the dead holder's lock is still young
        with run_lock(root, ttl_s=TTL):
            pass
    deadline = killed + 4 * TTL
    while True:
        try:
            with run_lock(root, ttl_s=TTL, beat_s=0.5) as lock:
                assert isinstance(lock, ObjectRunLock)
                assert _lock_body(root, s3_endpoint.options)["holder"] == lock.holder
                waited = time.monotonic() - killed
                with pytest.raises(RootInUse):    # and it keeps others out in its own process too
                    with run_lock(root, ttl_s=TTL):
                        pass
            break
        except RootInUse:
            assert time.monotonic() < deadline, "the dead holder's lock was never taken over"
            time.sleep(0.5)
    assert waited >= TTL - 1.5                    # not before the ttl (the store's clock has 1 s steps)
    assert not object_filesystem(root, s3_endpoint.options).exists(f"{root}/{RUN_LOCK}")  # released at the end
    with run_lock(root, ttl_s=TTL):               # so the next run takes it at once
        pass


def test_a_holder_that_stalled_past_the_ttl_learns_it_was_taken_over(s3_endpoint, s3_bucket, caplog):
    root = f"{s3_bucket}/stall"
    fs = object_filesystem(root, s3_endpoint.options)
    first = ObjectRunLock(f"{root}/{RUN_LOCK}", fs, TTL, 0.2)
    first.acquire()
    first._stop.set()                             # its driver stalls: no renewals
    first._thread.join()
    time.sleep(TTL + 1.0)
    with caplog.at_level(logging.WARNING, logger="raytrain_ckpt.checkpoint.storage.leases"):
        with run_lock(root, ttl_s=TTL) as second:
            assert "took over the run lock of pid" in caplog.text
            first._stop.clear()                   # the stalled driver wakes up and renews
            first._thread = None
            assert not first.renew() and first.lost.is_set()
            assert "another run (pid" in caplog.text and "took this job's root over" in caplog.text
            first.release()                       # a lost lock is not deleted: it is the second run's
            assert _lock_body(root, s3_endpoint.options)["holder"] == second.holder
    assert not fs.exists(f"{root}/{RUN_LOCK}")


def test_other_object_stores_are_not_locked_and_say_so(caplog):
    with caplog.at_level(logging.WARNING, logger="raytrain_ckpt.checkpoint.storage.leases"):
        with run_lock("memory://bucket/job") as lock:
            assert lock is None
    assert "no run lock on this store" in caplog.text


def test_a_write_whose_reply_was_lost_is_recognised_and_a_lock_removed_by_hand_is_written_again(s3_endpoint,
                                                                                                 s3_bucket):
    root = f"{s3_bucket}/retried"
    fs = object_filesystem(root, s3_endpoint.options)
    lock = ObjectRunLock(f"{root}/{RUN_LOCK}", fs, TTL, 60.0)
    lock.acquire()
    try:
        lock._acquire()                            # a retried create of its own: refused, its own id, kept
        assert not lock.lost.is_set()
        lock.beat += 1
        lock._put(IfMatch=lock.etag)               # a renewal applied whose reply never came ...
        lock.beat -= 1
        assert lock.renew() and not lock.lost.is_set()   # ... so its retry is refused: its own write, kept
        assert lock.renew() and _lock_body(root, s3_endpoint.options)["beat"] == lock.beat  # and it goes on
        fs.rm_file(f"{root}/{RUN_LOCK}")           # an operator removes the lock
        assert lock.renew() and _lock_body(root, s3_endpoint.options)["id"] == lock.id
        with pytest.raises(RootInUse):
            with run_lock(root, ttl_s=TTL):
                pass
    finally:
        lock.release()
    assert not fs.exists(f"{root}/{RUN_LOCK}")


def test_a_store_that_cannot_be_reached_is_one_clear_error(tmp_path):
    import socket

    with socket.socket() as s:                     # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
               "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(RootInUse, match=rf"could not take this job's run lock s3://nowhere/job/{RUN_LOCK} .*"
                                        r"check the store's endpoint and credentials"):
        with run_lock("s3://nowhere/job", options=options):
            pass
