"""Deterministic, index-addressed training data and its data-parallel split.

Names are imported on first use: the spec reads ``data.suffixes`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DataSources": "build", "build_data": "build",
    "FeistelPermutation": "permutation",
    "first_sample_of_step": "sampler", "local_micro_batches": "sampler", "local_sample_range": "sampler",
    "ByteTextTokens": "sources", "SyntheticTokens": "sources", "TokenSource": "sources", "build_source": "sources",
    "TEXT_SUFFIXES": "suffixes",
    "META_FILE": "tokens", "TOKEN_DTYPES": "tokens", "CorpusWindows": "tokens", "DatasetWindows": "tokens",
    "ShuffledWindows": "tokens", "TokenCorpus": "tokens",
    "SampleSkips": "skips", "SkipWindow": "skips",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
