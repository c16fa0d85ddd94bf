"""CRC-32C arithmetic: combining checksums equals checksumming the concatenation, and a staging
buffer's CRC-32C derived from the chunks a real write took equals the CRC-32C of its bytes."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from raytrain_ckpt.checkpoint.format.crc import Span, combine, region_crc
from raytrain_ckpt.checkpoint.datapath.filewrite import _GATHER
from raytrain_ckpt.checkpoint.datapath.localfile import write_rank_files
from raytrain_ckpt.checkpoint.datapath.staging import StagedPlanner, map_whole, views_of
from tests.unit.test_filewrite import _plan_and_stage


@pytest.mark.parametrize("len_a,len_b", [(0, 0), (0, 9), (9, 0), (1, 1), (13, 1000), (4096, 2 << 20),
                                         (7, 123_457), (1 << 20, 3)])
def test_combine_is_the_crc_of_the_concatenation(len_a: int, len_b: int) -> None:
    a, b = os.urandom(len_a), os.urandom(len_b)
    assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len_b) == crc32c.crc32c(a + b)


def _spans_of(region: memoryview, address: int, pieces: list[tuple[int, int]]) -> list[Span]:
    """Spans as a file stream records them: other bytes (headers) written between the pieces."""
    spans, crc = [], 0
    for offset, length in pieces:
        crc = crc32c.crc32c(os.urandom(37), crc)
        before, crc = crc, crc32c.crc32c(region[offset:offset + length], crc)
        spans.append(Span(address + offset, length, before, crc))
    return spans


@pytest.mark.parametrize("pieces", [
    [],                                                     # nothing covered: all read
    [(0, 1 << 20)],                                         # everything covered
    [(64, 100_000), (200_000, 300_000), (600_000, 448_512), (10, 5)],  # gaps, out of order
    [(0, 500_000), (100_000, 600_000), (100_000, 10)],      # overlaps: the first (by address) counts
])
def test_region_crc_from_spans_and_gaps(pieces: list[tuple[int, int]]) -> None:
    data = bytearray(os.urandom(1 << 20))
    region = memoryview(data)
    address = np.frombuffer(region, np.uint8).ctypes.data
    spans = _spans_of(region, address, pieces)
    outside = [Span(address - 10, 20, 1, 2), Span(address + len(data) - 5, 10, 3, 4), Span(0, 8, 5, 6)]
    assert region_crc(region, address, spans + outside) == crc32c.crc32c(data)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_buffer_crc_from_a_real_write_equals_its_bytes(tmp_path: Path, threads: int) -> None:
    """Large tensors are written straight from the buffer and their bytes are not read again;
    small ones (gathered), padding and slots the plan does not write are read."""
    g = torch.Generator().manual_seed(5)
    state = {"big": torch.randn(300, 301, generator=g), "big2": torch.randn(70_000, generator=g).to(torch.bfloat16),
             "small": torch.randn(7, generator=g), "step": 3}
    plan, _, owned, slots, nbytes, objects = _plan_and_stage(state, tmp_path)
    try:
        whole = map_whole(owned.path, nbytes)
        address = np.frombuffer(whole, np.uint8).ctypes.data
        staged = {**views_of(whole, slots), **objects}
        (tmp_path / "out").mkdir()
        written = write_rank_files(tmp_path / "out", plan, StagedPlanner(staged).resolve_data, threads)
        inside = [s for s in written.spans if address <= s.address < address + nbytes]
        large = sum(s.nbytes for s in slots if s.nbytes >= _GATHER)
        assert sum(s.length for s in inside) == large > 0  # the large slots' bytes all came from spans
        assert region_crc(whole, address, written.spans) == crc32c.crc32c(whole)
        whole[slots[-1].offset + slots[-1].nbytes] ^= 0xFF  # a padding byte changed after the write: it is read
        assert region_crc(whole, address, written.spans) == crc32c.crc32c(whole)
    finally:
        owned.remove()
