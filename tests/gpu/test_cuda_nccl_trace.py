"""The NCCL flight recorder of real NCCL ranks (two with two GPUs, else one), dumped after a
collective and kept as a hang's diagnostics keep it. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from raytrain_ckpt.rank.nccl_trace import TRACE_ENV, enable_recorder, keep_traces, rank_trace, traces_in
from tests.distributed.launch import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _all_reduce_then_dump() -> bytes | str:
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    assert x[0].item() == dist.get_world_size()
    return rank_trace()


def test_nccl_ranks_dump_their_flight_recorder(tmp_path: Path, monkeypatch):
    # what a rank does before joining an NCCL group, for the ranks' (spawned) processes
    env: dict[str, str] = {}
    enable_recorder(env)
    monkeypatch.setenv(TRACE_ENV, env[TRACE_ENV])
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    world = min(2, torch.cuda.device_count())
    dumps = run_ranks(_all_reduce_then_dump, world, backend="nccl")
    assert all(isinstance(d, bytes) and d for d in dumps), dumps
    lines = keep_traces(tmp_path, dict(enumerate(dumps)), world)
    assert traces_in(tmp_path) == list(range(world)), lines
    for rank in range(world):
        data = (tmp_path / f"rank-{rank}.nccl_trace.pkl").read_bytes()
        assert data == dumps[rank] and b"all_reduce" in data, lines
