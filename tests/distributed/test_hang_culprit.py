"""The culprit of a hang, from stacks read with py-spy out of three real processes in a gloo
process group: two wait in an all_reduce, the third never enters it."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from raytrain_ckpt.control.watch.hangs import blame, dump_stacks, in_collective, py_spy, training_thread

pytestmark = pytest.mark.skipif(py_spy() is None, reason="py-spy is a dependency of the project")

_GLOO = """
    import datetime, sys, time
    import torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=120))
    def stuck_elsewhere():
        time.sleep(600)
    print("ready", flush=True)
    if rank == 2:
        stuck_elsewhere()
    dist.all_reduce(torch.ones(4))
"""


def test_the_rank_outside_the_collective_its_peers_wait_in_is_blamed():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_GLOO), str(r), str(port)],
                              stdout=subprocess.PIPE, text=True) for r in range(3)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # ranks 0 and 1 enter the all_reduce
        stacks = {r: dump_stacks(p.pid) for r, p in enumerate(procs)}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert in_collective(training_thread(stacks[0])) and in_collective(training_thread(stacks[1])), stacks[0]
    verdict = blame(3, {0: 7, 1: 7, 2: 7}, stacks)
    assert verdict.ranks == (2,), verdict
    assert verdict.reason == "rank 2 not in the collective that rank 0, 1 wait in (all at step 7)"
    assert verdict.where().startswith("stuck_elsewhere (<string>")
