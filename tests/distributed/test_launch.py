"""The harness's report of a failed group names the rank that raised, not only the peer that
lost it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed


def _rank_1_raises() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1's own error")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that has left
    return int(t.item())


def test_the_rank_that_raised_is_reported_first_with_every_other_rank():
    with pytest.raises(RuntimeError) as info:
        run_ranks(_rank_1_raises, 2)
    text = str(info.value)
    assert text.startswith("rank 1 failed:") and "ValueError: rank 1's own error" in text, text
    assert "rank 0 failed:" in text, text       # the peer's error is kept, after it
