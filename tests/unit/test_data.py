"""Unit tests for raytrain_ckpt.data (no Ray, no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytrain_ckpt.data import (
    ByteTextTokens,
    SyntheticTokens,
    TokenSource,
    build_source,
    first_sample_of_step,
    local_micro_batches,
)


def _global_batch(source: TokenSource, step: int, gbs: int, start: int = 0) -> torch.Tensor:
    """Reference: the global batch built directly from sample indices."""
    first = start + step * gbs
    return torch.stack([source.sample(i) for i in range(first, first + gbs)])


def _union_over_ranks(
    source: TokenSource, step: int, gbs: int, mbs: int, dp_size: int, start: int = 0
) -> torch.Tensor:
    """Concatenate every rank's micro batches (rank order) into full samples."""
    rows = []
    for rank in range(dp_size):
        for inputs, targets in local_micro_batches(
            source,
            step=step,
            global_batch_size=gbs,
            micro_batch_size=mbs,
            dp_rank=rank,
            dp_size=dp_size,
            start_index=start,
        ):
            assert inputs.dtype == targets.dtype == torch.long
            assert inputs.shape == (mbs, source.seq_len)
            torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
            rows.append(torch.cat([inputs, targets[:, -1:]], dim=1))
    return torch.cat(rows)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha " * 50)
    (root / "sub" / "b.md").write_text("# beta\n" * 40)
    (root / "c.py").write_text("x = 1\n" * 30)
    (root / "image.bin").write_bytes(bytes(range(256)) * 4)
    return root


def test_synthetic_same_index_identical() -> None:
    src = SyntheticTokens(vocab_size=256, seq_len=16, seed=3)
    again = SyntheticTokens(vocab_size=256, seq_len=16, seed=3)
    for i in (0, 1, 17, 10**9):
        assert torch.equal(src.sample(i), again.sample(i))
        assert torch.equal(src.sample(i), src.sample(i))


def test_synthetic_indices_and_seeds_differ() -> None:
    src = SyntheticTokens(vocab_size=256, seq_len=16, seed=3)
    samples = {tuple(src.sample(i).tolist()) for i in range(50)}
    assert len(samples) > 40
    other = SyntheticTokens(vocab_size=256, seq_len=16, seed=4)
    assert any(not torch.equal(src.sample(i), other.sample(i)) for i in range(5))


def test_synthetic_shape_range_and_structure() -> None:
    src = SyntheticTokens(vocab_size=37, seq_len=20, seed=0)
    for i in range(30):
        s = src.sample(i)
        assert s.dtype == torch.long and s.shape == (21,)
        assert int(s.min()) >= 0 and int(s.max()) < 37
        diffs = (s[1:] - s[:-1]) % 37
        # An arithmetic progression: one constant, non-zero stride.
        assert len(set(diffs.tolist())) == 1 and int(diffs[0]) != 0


def test_synthetic_is_a_token_source() -> None:
    assert isinstance(SyntheticTokens(vocab_size=8, seq_len=4, seed=0), TokenSource)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_union_of_ranks_is_global_batch(dp_size: int) -> None:
    src = SyntheticTokens(vocab_size=256, seq_len=8, seed=7)
    expected = _global_batch(src, step=3, gbs=16)
    got = _union_over_ranks(src, step=3, gbs=16, mbs=2, dp_size=dp_size)
    assert torch.equal(got, expected)


def test_dp_split_is_independent_of_world_size() -> None:
    src = SyntheticTokens(vocab_size=256, seq_len=8, seed=7)
    reference = _union_over_ranks(src, step=5, gbs=8, mbs=1, dp_size=1)
    for dp_size in (2, 4, 8):
        assert torch.equal(_union_over_ranks(src, step=5, gbs=8, mbs=1, dp_size=dp_size), reference)


def test_resume_with_start_offset() -> None:
    src = SyntheticTokens(vocab_size=256, seq_len=8, seed=7)
    gbs, k = 8, 5
    original = _union_over_ranks(src, step=k, gbs=gbs, mbs=2, dp_size=2)
    # A job resumed after k steps restarts its step counter at 0 with an offset,
    # possibly with a different dp size.
    resumed = _union_over_ranks(src, step=0, gbs=gbs, mbs=4, dp_size=1, start=k * gbs)
    assert torch.equal(original, resumed)
    assert first_sample_of_step(k, gbs) == first_sample_of_step(0, gbs, start_index=k * gbs) == 40
    assert first_sample_of_step(2, 4, start_index=3) == 11


def test_consecutive_steps_do_not_overlap() -> None:
    src = SyntheticTokens(vocab_size=256, seq_len=8, seed=7)
    a = _global_batch(src, step=0, gbs=4)
    b = _union_over_ranks(src, step=1, gbs=4, mbs=2, dp_size=2)
    assert not any(torch.equal(row_a, row_b) for row_a in a for row_b in b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch_size": 10, "micro_batch_size": 1, "dp_rank": 0, "dp_size": 4}, "dp_size"),
        ({"global_batch_size": 8, "micro_batch_size": 3, "dp_rank": 0, "dp_size": 2}, "micro_batch"),
        ({"global_batch_size": 8, "micro_batch_size": 2, "dp_rank": 2, "dp_size": 2}, "dp_rank"),
        ({"global_batch_size": 8, "micro_batch_size": 0, "dp_rank": 0, "dp_size": 2}, "micro_batch"),
    ],
)
def test_sampler_validation(kwargs: dict[str, int], match: str) -> None:
    src = SyntheticTokens(vocab_size=16, seq_len=4, seed=0)
    with pytest.raises(ValueError, match=match):
        local_micro_batches(src, step=0, **kwargs)


def test_text_source_over_directory(corpus: Path) -> None:
    src = ByteTextTokens(corpus, seq_len=32, seed=0)
    expected = b"\n".join(
        p.read_bytes() for p in sorted([corpus / "a.txt", corpus / "c.py", corpus / "sub" / "b.md"])
    )
    assert src.num_bytes == len(expected)  # .bin file skipped, separators added
    assert src.num_windows == (len(expected) - 1) // 32
    windows = [expected[w * 32 : w * 32 + 33] for w in range(src.num_windows)]
    got = []
    for i in range(src.num_windows):
        s = src.sample(i)
        assert s.dtype == torch.long and s.shape == (33,)
        got.append(bytes(s.tolist()))
    # One epoch visits every window exactly once, in a shuffled order.
    assert sorted(got) == sorted(windows)
    assert got != windows


def test_text_source_epochs_and_determinism(corpus: Path) -> None:
    a = ByteTextTokens(corpus, seq_len=16, seed=1)
    b = ByteTextTokens(corpus, seq_len=16, seed=1)
    w = a.num_windows
    order_epoch0 = [a.sample(i).tolist() for i in range(w)]
    order_epoch1 = [a.sample(w + i).tolist() for i in range(w)]
    assert order_epoch0 != order_epoch1  # reshuffled per epoch
    assert sorted(order_epoch0) == sorted(order_epoch1)
    # Random access in any order matches, across instances (cache is per epoch).
    for i in (3 * w + 2, 0, w + 1, 3 * w + 2):
        assert torch.equal(a.sample(i), b.sample(i))


def test_text_source_single_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.log"  # explicit file: suffix filter does not apply
    path.write_text("hello world " * 10)
    src = ByteTextTokens(path, seq_len=8, seed=0)
    assert src.vocab_size == 256
    assert bytes(src.sample(0).tolist()) in path.read_bytes()


def test_text_source_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        ByteTextTokens(tmp_path / "missing", seq_len=8, seed=0)
    (tmp_path / "only.bin").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="no files"):
        ByteTextTokens(tmp_path, seq_len=8, seed=0)
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ValueError, match="fewer than"):
        ByteTextTokens(short, seq_len=8, seed=0)


def test_build_source(corpus: Path) -> None:
    synthetic = build_source("synthetic", seq_len=8, seed=0, vocab_size=100, path=None)
    assert isinstance(synthetic, SyntheticTokens) and synthetic.vocab_size == 100
    text = build_source("text", seq_len=8, seed=0, vocab_size=256, path=corpus)
    assert isinstance(text, ByteTextTokens)
    with pytest.raises(ValueError, match="path"):
        build_source("text", seq_len=8, seed=0, vocab_size=256, path=None)
    with pytest.raises(ValueError, match="vocab_size"):
        build_source("text", seq_len=8, seed=0, vocab_size=100, path=corpus)
    with pytest.raises(ValueError, match="unknown data kind"):
        build_source("parquet", seq_len=8, seed=0, vocab_size=256, path=None)
