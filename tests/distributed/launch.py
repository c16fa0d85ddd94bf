"""Run a function on N real processes joined in a torch.distributed process group."""

from __future__ import annotations

import datetime
import io
import os
import queue as queues
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# What a rank imports, imported once in the fork server: each rank is then a fork of it (a real,
# separate process) instead of a fresh interpreter importing torch and the trainer (2-3 s of CPU).
_PRELOAD = ("torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.pipelining",
            "raytrain_ckpt.rank.trainer", "raytrain_ckpt.checkpoint.roles.client", "tests.distributed.launch")


def _context(backend: str) -> Any:
    if backend == "nccl":
        return mp.get_context("spawn")  # CUDA: every rank a fresh interpreter
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue: Any) -> None:
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        try:
            # Serialise to bytes: torch's queue would share tensors through handles that
            # die with this process before the parent reads them.
            buf = io.BytesIO()
            torch.save(fn(*args), buf)
            queue.put((rank, "ok", buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args: Any, backend: str = "gloo", timeout_s: float = 300) -> list[Any]:
    """Call ``fn(*args)`` on ``world`` new processes; return the results ordered by rank."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the fork server starts: its forks inherit its environment
    ctx = _context(backend)
    queue = ctx.Queue()
    # The parent serves the rendezvous store on a port the kernel picks as it binds: a port
    # found free and bound later by a rank can be taken in between by any other process.
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    port = store.port
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "error":
                raise RuntimeError(_failures(queue, world - len(out) - 1, {rank: value}))
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def _failures(queue: Any, pending: int, errors: dict[int, str], wait_s: float = 15.0) -> str:
    """Every rank's error, not only the first to arrive: a rank that raises closes its process
    group before it reports, so its peers' "connection reset" can reach the queue first. The
    errors that name no lost peer (the likely cause) come first."""
    deadline = time.monotonic() + wait_s
    while pending > 0 and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=max(0.1, deadline - time.monotonic()))
        except queues.Empty:
            break
        pending -= 1
        if status == "error":
            errors[rank] = value
    peer_lost = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
    order = sorted(errors, key=lambda r: (any(p in errors[r] for p in peer_lost), r))
    silent = f"\n({pending} rank(s) sent nothing: died without a Python error?)" if pending else ""
    return "\n".join(f"rank {r} failed:\n{errors[r]}" for r in order) + silent
