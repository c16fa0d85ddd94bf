"""Training and held-out sources of a job, from the data section's fields."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_ckpt.data.sources import SyntheticTokens, TokenSource, build_source
from raytrain_ckpt.data.tokens import CorpusWindows, DatasetWindows, ShuffledWindows, TokenCorpus, Windows
from raytrain_ckpt.models import resolve_factory

logger = logging.getLogger(__name__)

__all__ = ["EVAL_SYNTHETIC_OFFSET", "DataSources", "build_data"]

EVAL_SYNTHETIC_OFFSET = 1 << 62
"""Synthetic held-out samples are this far into the stream, where training never gets."""


@dataclass(frozen=True)
class DataSources:
    """What a trainer reads: the training stream and the held-out one (None without a split)."""

    train: TokenSource
    eval: TokenSource | None
    eval_offset: int = 0
    """Index of the first held-out sample in ``eval``."""


def _user_windows(source: str, kwargs: dict[str, Any], seq_len: int, vocab_size: int,
                  bos_id: int | None) -> Windows:
    factory = resolve_factory(source)
    try:
        dataset = factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"data.source={source!r} rejected data.kwargs {kwargs}: {exc}") from None
    return DatasetWindows(dataset, seq_len, vocab_size, source, bos_id)


def _split(windows: Windows, vocab_size: int, seed: int, fraction: float | None) -> tuple[TokenSource, TokenSource | None]:
    """Carve the last ``fraction`` of the windows off as the held-out split (at least one each)."""
    n = len(windows)
    if fraction is None:
        return ShuffledWindows(windows, vocab_size, seed), None
    held = max(1, int(n * fraction))
    if held >= n:
        raise ValueError(f"data.eval_fraction={fraction} of {n} samples leaves none to train on; "
                         "lower it or add data")
    return ShuffledWindows(windows, vocab_size, seed, 0, n - held), ShuffledWindows(windows, vocab_size, seed, n - held, n)


def build_data(*, source: str, path: Path | None, dtype: str, eval_path: Path | None, eval_fraction: float | None,
               bos_id: int | None, kwargs: dict[str, Any], seq_len: int, seed: int, vocab_size: int) -> DataSources:
    """Build the training and held-out sources named by the data section.

    Raises:
        ValueError: For data that cannot be read or does not fit the model (vocabulary, length).
    """
    if source == "synthetic":
        train = SyntheticTokens(vocab_size=vocab_size, seq_len=seq_len, seed=seed)
        return DataSources(train, train, EVAL_SYNTHETIC_OFFSET)
    if source == "text":
        return DataSources(build_source("text", seq_len=seq_len, seed=seed, vocab_size=vocab_size, path=path), None)
    if source == "tokens":
        if path is None:
            raise ValueError("data.source=tokens needs data.path (a shard or a directory of shards)")
        windows: Windows = CorpusWindows(TokenCorpus(path, dtype, vocab_size), seq_len, bos_id)
    else:
        windows = _user_windows(source, kwargs, seq_len, vocab_size, bos_id)
    train, held = _split(windows, vocab_size, seed, eval_fraction)
    if eval_path is not None:
        held = ShuffledWindows(CorpusWindows(TokenCorpus(eval_path, dtype, vocab_size), seq_len, bos_id),
                               vocab_size, seed)
    logger.debug("data %s: train %r, eval %r", source, train, held)
    return DataSources(train, held)
