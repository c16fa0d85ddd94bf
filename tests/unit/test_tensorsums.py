"""The manifest's fingerprints are summed beside the CRC-32C as a writer writes (one pass over
bytes in the cache) and give the answers of a full float64 computation: the same element, NaN
and Inf counts, the same sums and norms within float32 cascade summation's error, for ordinary,
non-finite, overflowing, low-precision and multi-chunk tensors, on every writing path."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer
from raytrain_ckpt.checkpoint.datapath.localfile import write_rank_files
from raytrain_ckpt.checkpoint.datapath.staging import StagedPlanner, map_buffer, map_slots, plan_slots, slot_views
from raytrain_ckpt.checkpoint.format.fingerprints import merge_shard_sums, shard_sums, tensor_stats
from raytrain_ckpt.checkpoint.format.tensorsums import CHUNK_BYTES, SumsAccumulator, tensor_sums


def _exact(t: torch.Tensor) -> tuple[int, float, float, int, int]:
    """The reference: the whole tensor widened to float64, counted and summed (what the writers
    computed before the sums moved beside the checksum)."""
    wide = t.reshape(-1).to(torch.float64)
    finite = torch.isfinite(wide)
    nan = int(torch.isnan(wide).sum())
    good = wide[finite]
    return (int(wide.numel()), float(good.sum()), float((good * good).sum()), nan,
            int(wide.numel()) - int(finite.sum()) - nan)


def _assert_close(got, want, abs_scale: float) -> None:
    assert (got[0], got[3], got[4]) == (want[0], want[3], want[4])
    assert math.isclose(got[1], want[1], rel_tol=1e-6, abs_tol=1e-6 * abs_scale), (got, want)
    assert math.isclose(got[2], want[2], rel_tol=1e-6), (got, want)


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    big = torch.randn(3 * CHUNK_BYTES // 4 + 123, generator=g)  # several chunks and a partial one
    with_nan = big.clone()
    with_nan[CHUNK_BYTES // 4 + 7] = math.nan  # in the second chunk only
    both_inf = torch.randn(1000, generator=g)
    both_inf[3], both_inf[9] = math.inf, -math.inf  # their sum is NaN: counted as 2 Inf, no NaN
    overflow32 = torch.full((64,), 3e30)  # finite, but its squares overflow float32
    huge64 = torch.full((8,), 1e200, dtype=torch.float64)  # finite, squares overflow float64
    return {"ordinary": big, "nan": with_nan, "inf": both_inf, "overflow32": overflow32, "huge64": huge64,
            "bf16": torch.randn(70_001, generator=g).to(torch.bfloat16),
            "fp16": torch.randn(5_000, generator=g).to(torch.float16),
            "fp16_inf": torch.tensor([1.0, 70000.0, math.nan], dtype=torch.float16),
            "f64": torch.randn(300_000, generator=g, dtype=torch.float64), "empty": torch.zeros(0)}


@pytest.mark.parametrize("name", list(_cases()))
def test_the_sums_are_those_of_a_float64_pass(name: str) -> None:
    t = _cases()[name]
    got, want = tensor_sums(t), _exact(t)
    if name == "huge64":  # squares past float64: both say inf, and the counts still agree
        assert got[2] == want[2] == math.inf and got[0] == want[0] and got[3:] == want[3:]
        return
    _assert_close(got, want, float(t.to(torch.float64).abs().nan_to_num(0, 0, 0).sum()) if t.numel() else 1.0)


def test_pieces_in_any_order_make_the_same_counts() -> None:
    t = _cases()["nan"]
    acc = SumsAccumulator()
    for piece in reversed(t.split(100_000)):
        acc.add(piece)
    assert (acc.row()[0], acc.row()[3], acc.row()[4]) == (t.numel(), 1, 0)


def _staged_write(tmp_path: Path, state: dict, threads: int):
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    central, _ = planner.create_global_plan([planner.create_local_plan()])
    plan = planner.finish_plan(FileSystemWriter(tmp_path).prepare_global_plan(central)[0])
    tensors = {k: v for k, v in planner.state_dict.items() if isinstance(v, torch.Tensor)}
    objects = {k: v for k, v in planner.state_dict.items() if not isinstance(v, torch.Tensor)}
    slots, nbytes = plan_slots(tensors)
    owned = OwnedBuffer.create(tmp_path / "rtc-test-sums-rank0.buf", nbytes)
    try:
        for fqn, view in slot_views(map_buffer(owned.path, nbytes), slots).items():
            view.copy_(tensors[fqn])
        out = tmp_path / "files"
        out.mkdir()
        staged = {**map_slots(owned.path, nbytes, slots), **objects}
        return write_rank_files(out, plan, StagedPlanner(staged).resolve_data, threads), tensors
    finally:
        owned.remove()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_write_sums_every_floating_tensor_it_writes(tmp_path: Path, threads: int) -> None:
    """Large tensors (summed chunk by chunk, in place) and small ones (gathered with their
    records, summed whole) alike; integer tensors and byte items are not summed."""
    cases = _cases()
    state = {"model": {k: v for k, v in cases.items() if k != "huge64"},
             "ints": torch.arange(1 << 20, dtype=torch.int32), "step": 3, "blob": b"x" * 100_000}
    written, tensors = _staged_write(tmp_path, state, threads)
    assert written.sums is not None
    floating = {fqn for fqn, t in tensors.items() if t.is_floating_point()}
    assert set(written.sums) == floating and "ints" not in written.sums
    for fqn in floating:
        t = tensors[fqn]
        _assert_close(written.sums[fqn], _exact(t),
                      float(t.to(torch.float64).abs().nan_to_num(0, 0, 0).sum()) if t.numel() else 1.0)
    assert written.phases.sums_s > 0
    # the staged views summed after the write (the path that does not sum as it writes) agree
    assert shard_sums(tensors, set(tensors)).keys() == written.sums.keys()


def test_the_manifest_rows_agree_with_what_stats_reads_from_the_files() -> None:
    """merge -> manifest row: count, NaN and Inf exact, the norm within 1e-6 of ``stats``' float64
    fingerprint of the same tensor (``tensor_stats``, what ``stats`` computes from a step's files)."""
    cases = _cases()
    state = {"model.a": cases["ordinary"], "model.b": cases["inf"], "model.c": cases["bf16"], "model.d": cases["nan"]}
    rows = merge_shard_sums([{k: tensor_sums(v[: v.numel() // 2])} for k, v in state.items()]
                            + [{k: tensor_sums(v[v.numel() // 2:])} for k, v in state.items()])
    for name, row in rows.items():
        s = tensor_stats(state[name])
        assert (row["numel"], row["nan"], row["inf"]) == (s.numel, s.nan, s.inf), name
        if s.finite:
            assert math.isclose(row["norm"], s.norm, rel_tol=1e-6), name
            assert math.isclose(row["sum"], s.sum, rel_tol=1e-6, abs_tol=1e-6 * s.numel), name
