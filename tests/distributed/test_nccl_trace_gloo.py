"""A rank of a real gloo group asked for its NCCL flight recorder says it has none."""

from __future__ import annotations

from raytrain_ckpt.rank.nccl_trace import rank_trace
from tests.distributed.launch import run_ranks


def test_gloo_ranks_answer_that_they_have_no_flight_recorder():
    assert run_ranks(rank_trace, 2) == ["no flight recorder: backend gloo"] * 2
