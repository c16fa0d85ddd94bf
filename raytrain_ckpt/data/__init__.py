"""Deterministic, index-addressed training data and its data-parallel split."""

from raytrain_ckpt.data.sampler import first_sample_of_step, local_micro_batches, local_sample_range
from raytrain_ckpt.data.sources import (
    TEXT_SUFFIXES,
    ByteTextTokens,
    SyntheticTokens,
    TokenSource,
    build_source,
)

__all__ = [
    "TEXT_SUFFIXES",
    "ByteTextTokens",
    "SyntheticTokens",
    "TokenSource",
    "build_source",
    "first_sample_of_step",
    "local_micro_batches",
    "local_sample_range",
]
