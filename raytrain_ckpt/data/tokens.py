"""Pre-tokenized corpora, memory-mapped, and user datasets, as index-addressed samples.

A corpus is one or more shards (flat ``.bin`` token arrays of ``uint16``/``uint32``, or
``.npy`` arrays) read through ``numpy.memmap``: the pages a sample touches are mapped in by
the OS and can be dropped again, so host memory does not grow with the corpus. The shards,
in sorted path order, form one stream of ``T`` tokens, cut into windows of ``seq_len + 1``
tokens at stride ``seq_len`` (with a BOS id, windows of ``seq_len`` tokens that the BOS
precedes). A user dataset is a sequence of items, each one window.

``ShuffledWindows`` turns a contiguous range of windows into a ``TokenSource``: sample ``i``
is window ``lo + perm_e(i mod n)`` of epoch ``e = i // n``, with ``perm_e`` a Feistel
permutation keyed by ``(seed, e)``. Nothing else enters, so sample ``i`` is the same for any
world size, after any resume.
"""

from __future__ import annotations

import bisect
import json
import logging
import mmap
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from raytrain_ckpt.data.permutation import FeistelPermutation
from raytrain_ckpt.data.suffixes import input_files, open_regular

logger = logging.getLogger(__name__)

__all__ = [
    "META_FILE", "TOKEN_DTYPES", "CorpusWindows", "DatasetWindows", "ShuffledWindows", "TokenCorpus", "Windows",
    "check_meta", "read_meta",
]

TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
META_FILE = "meta.json"
"""Written by ``raytrain-ckpt prepare-data`` next to the shards: tokenizer hash, vocab size, dtype, counts."""

_SHARD_SUFFIXES = (".bin", ".npy")


class Windows(Protocol):
    """A finite, indexable set of token windows of ``seq_len + 1`` tokens."""

    seq_len: int

    def __len__(self) -> int: ...

    def window(self, index: int) -> torch.Tensor:
        """Window ``index`` as a LongTensor of ``seq_len + 1`` tokens."""
        ...


def _shard_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = [p for p in input_files(path, _SHARD_SUFFIXES) if p.suffix in _SHARD_SUFFIXES]
    if not files:
        raise ValueError(f"token data directory {str(path)!r} has no .bin or .npy shards; "
                         "write them with `raytrain-ckpt prepare-data`")
    return files


def _open_shard(path: Path, dtype: np.dtype) -> np.ndarray:
    """A read-only memory map of one shard; checks it is a regular file, its size and dtype."""
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # (a shard meta.json lists, removed since: said below)
        regular = True
    if not regular:  # a FIFO would block np.load forever, and memory-map as 0 tokens
        raise ValueError(f"token shard {str(path)!r} is not a regular file (a FIFO, device, socket or directory); "
                         "remove it, or rerun `raytrain-ckpt prepare-data`")
    if path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 1 or arr.dtype.kind not in "ui":
            raise ValueError(f"token shard {str(path)!r}: a 1-d integer array is needed, got {arr.ndim}-d "
                             f"{arr.dtype}; save the tokens flat, e.g. np.save(path, ids.astype(np.uint32))")
        return _random_access(arr)
    if path.suffix != ".bin":
        raise ValueError(f"token shard {str(path)!r}: expected a .bin or .npy file")
    try:
        size = path.stat().st_size
    except OSError as exc:  # a shard meta.json lists, removed since
        raise ValueError(f"token shard {str(path)!r} cannot be read ({exc.strerror or exc}); restore it, or "
                         "rerun `raytrain-ckpt prepare-data`") from None
    if size % dtype.itemsize:
        raise ValueError(f"token shard {str(path)!r} has {size} bytes, not a multiple of {dtype.itemsize} "
                         f"(data.dtype={dtype.name}); the shard was written with another dtype: set data.dtype")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return _random_access(np.memmap(path, dtype=dtype, mode="r"))


def _random_access(arr: np.ndarray) -> np.ndarray:
    """Tell the kernel that ``arr``'s pages are read at random.

    Without it every page fault reads ahead (128 KiB or more) around a sample of a few
    hundred bytes, and a process's resident memory grows with the corpus it samples from.
    """
    mm = getattr(arr, "_mmap", None)  # numpy keeps the mmap object of a memmap here
    if isinstance(mm, mmap.mmap) and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    return arr


MAX_META_BYTES = 64 << 20
"""A ``meta.json`` past this is not one prepare-data wrote (a million shards take about 40 MB)."""

_REWRITE = "rerun `raytrain-ckpt prepare-data` into a new directory"


def read_meta(path: Path) -> dict[str, Any] | None:
    """The ``meta.json`` next to the shards (the directory itself, or a single shard's parent).

    Raises:
        ValueError: It is not a regular file, too large, unreadable, not JSON, or not an object of
            the fields prepare-data writes (each field read is checked for its type here, so that
            no later use of it can fail on a damaged file).
    """
    meta = (path if path.is_dir() else path.parent) / META_FILE
    if not meta.exists():
        return None
    try:
        with open_regular(meta) as f:
            raw = f.read(MAX_META_BYTES + 1)
        if len(raw) > MAX_META_BYTES:
            raise ValueError(f"more than {MAX_META_BYTES} bytes")
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        why = "nested too deep" if isinstance(exc, RecursionError) else str(exc).split(";")[0].removeprefix(f"{meta} ")
        raise ValueError(f"{meta} is unreadable ({why[:200]}); {_REWRITE}") from None
    problem = _meta_problem(data)
    if problem is not None:
        raise ValueError(f"{meta} is not what prepare-data writes ({problem}); {_REWRITE}")
    return data


def _meta_problem(data: Any) -> str | None:
    """What in a parsed ``meta.json`` is not of the shape prepare-data writes, or None."""
    if not isinstance(data, dict):
        return f"a JSON object is needed, got {type(data).__name__}"
    dtype, vocab = data.get("dtype"), data.get("vocab_size")
    if dtype is not None and (not isinstance(dtype, str) or dtype not in TOKEN_DTYPES):
        return f"dtype={str(dtype)[:40]!r}: one of {sorted(TOKEN_DTYPES)} is written"
    if vocab is not None and (type(vocab) is not int or not 0 < vocab <= 1 << 32):
        return f"vocab_size={str(vocab)[:40]}: a whole number from 1 to 2**32 is written"
    shards = data.get("shards", {})  # name -> tokens (a list of names in older ones)
    if not isinstance(shards, (dict, list)) or not all(isinstance(n, str) and n and "/" not in n for n in shards):
        return "shards must be the shards' file names"
    if isinstance(shards, dict) and not all(type(n) is int and n >= 0 for n in shards.values()):
        return "shards must map each file name to its token count"
    return None


class TokenCorpus:
    """Memory-mapped token shards addressed as one stream.

    Args:
        path: A shard file, or a directory searched recursively for ``.bin``/``.npy`` shards.
        dtype: Token type of ``.bin`` shards (``uint16`` or ``uint32``); ``.npy`` carry their own.
        vocab_size: The model's vocabulary; a ``meta.json`` declaring a larger one is refused,
            and so is any sample holding an id outside it.

    Raises:
        ValueError: For a missing path, no shards, a size that does not fit the dtype, or a
            ``meta.json`` that disagrees with ``dtype`` or ``vocab_size``.
    """

    def __init__(self, path: Path, dtype: str, vocab_size: int) -> None:
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"data.dtype={dtype!r}: expected one of {sorted(TOKEN_DTYPES)}")
        self.path = Path(path)
        if not self.path.exists():
            raise ValueError(f"token data path {str(self.path)!r} does not exist")
        self.vocab_size = vocab_size
        meta = read_meta(self.path)
        check_meta(meta, dtype, vocab_size, where=str(self.path))
        if self.path.is_dir() and meta is not None and "shards" in meta:
            # prepare-data lists its shards: a stale shard of a removed input is not read
            self.files = [self.path / name for name in meta["shards"]]
        else:
            self.files = _shard_files(self.path)
        self._shards = [_open_shard(f, TOKEN_DTYPES[dtype]) for f in self.files]
        self._starts = [0]
        for shard in self._shards:
            self._starts.append(self._starts[-1] + len(shard))

    @property
    def num_tokens(self) -> int:
        """Tokens in all shards."""
        return self._starts[-1]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream, as int64 (may span shards)."""
        out = np.empty(length, dtype=np.int64)
        pos, filled = start, 0
        shard = bisect.bisect_right(self._starts, pos) - 1
        while filled < length:
            lo = pos - self._starts[shard]
            take = min(length - filled, len(self._shards[shard]) - lo)
            out[filled:filled + take] = self._shards[shard][lo:lo + take]
            filled += take
            pos += take
            shard += 1
        return out


def check_meta(meta: dict[str, Any] | None, dtype: str, vocab_size: int, where: str) -> None:
    """Refuse shards whose ``meta.json`` declares another dtype or a larger vocabulary than the model's."""
    if meta is None:
        return
    if meta.get("dtype") not in (None, dtype):
        raise ValueError(f"{where}: shards were written as {meta['dtype']} ({META_FILE}) but data.dtype={dtype}; "
                         f"set data.dtype={meta['dtype']}")
    declared = meta.get("vocab_size")  # (an int: read_meta checked it)
    if declared is not None and declared > vocab_size:
        raise ValueError(f"{where}: the tokenizer has vocab_size {declared} ({META_FILE}) but the model has "
                         f"{vocab_size}; set model.overrides.vocab_size >= {declared}")


class CorpusWindows:
    """Windows of a ``TokenCorpus``: ``seq_len + 1`` tokens at stride ``seq_len``, or
    ``seq_len`` tokens after ``bos_id``."""

    def __init__(self, corpus: TokenCorpus, seq_len: int, bos_id: int | None = None) -> None:
        self.corpus, self.seq_len, self.bos_id = corpus, seq_len, bos_id
        take = seq_len if bos_id is not None else seq_len + 1
        self._take = take
        self._count = max(0, (corpus.num_tokens - (take - seq_len)) // seq_len)
        if self._count == 0:
            raise ValueError(f"token corpus {str(corpus.path)!r} has {corpus.num_tokens} tokens, fewer than one "
                             f"sample of {take}; add data or lower training.seq_len")

    def __len__(self) -> int:
        return self._count

    def window(self, index: int) -> torch.Tensor:
        tokens = self.corpus.read(index * self.seq_len, self._take)
        if self.bos_id is not None:
            tokens = np.concatenate([np.array([self.bos_id], dtype=np.int64), tokens])
        return _checked(torch.from_numpy(tokens), self.corpus.vocab_size, f"{self.corpus.path} window {index}")


def _checked(tokens: torch.Tensor, vocab_size: int, where: str) -> torch.Tensor:
    top = int(tokens.max()) if tokens.numel() else 0
    if top >= vocab_size or int(tokens.min()) < 0:
        raise ValueError(f"{where}: token id {top if top >= vocab_size else int(tokens.min())} is outside the "
                         f"model vocabulary [0, {vocab_size}); the data was tokenized for a larger vocabulary "
                         "(raise model.overrides.vocab_size) or with another data.dtype")
    return tokens


class DatasetWindows:
    """Items of a map-style dataset (``len`` and ``[i]`` giving token ids) as windows.

    Item ``i`` must hold at least ``seq_len + 1`` token ids (``seq_len`` with ``bos_id``); the
    first ones are used.
    """

    def __init__(self, dataset: Sequence[Any], seq_len: int, vocab_size: int, name: str,
                 bos_id: int | None = None) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(f"data.source={name!r} returned {type(dataset).__name__}, expected a map-style dataset "
                             "(with __len__ and __getitem__ returning token ids)")
        if len(dataset) < 1:
            raise ValueError(f"data.source={name!r} returned an empty dataset")
        self.dataset, self.seq_len, self.vocab_size, self.name, self.bos_id = dataset, seq_len, vocab_size, name, bos_id

    def __len__(self) -> int:
        return len(self.dataset)

    def window(self, index: int) -> torch.Tensor:
        need = self.seq_len if self.bos_id is not None else self.seq_len + 1
        try:
            tokens = torch.as_tensor(self.dataset[index], dtype=torch.long).reshape(-1)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"data.source={self.name!r}: item {index} is not a sequence of token ids ({exc})") from None
        if tokens.numel() < need:
            raise ValueError(f"data.source={self.name!r}: item {index} has {tokens.numel()} tokens, fewer than the "
                             f"{need} a sample needs (training.seq_len={self.seq_len}); lower seq_len or join items")
        tokens = tokens[:need]
        if self.bos_id is not None:
            tokens = torch.cat([torch.tensor([self.bos_id]), tokens])
        return _checked(tokens, self.vocab_size, f"data.source={self.name!r} item {index}")


class ShuffledWindows:
    """Windows ``[lo, hi)`` of ``windows`` as an endless, epoch-wise shuffled ``TokenSource``."""

    def __init__(self, windows: Windows, vocab_size: int, seed: int, lo: int = 0, hi: int | None = None) -> None:
        hi = len(windows) if hi is None else hi
        if not 0 <= lo < hi <= len(windows):
            raise ValueError(f"window range [{lo}, {hi}) is empty or outside [0, {len(windows)})")
        self.windows, self.vocab_size, self.seq_len = windows, vocab_size, windows.seq_len
        self.seed, self.lo, self.n = seed, lo, hi - lo
        self._perm: tuple[int, FeistelPermutation] | None = None

    def _permutation(self, epoch: int) -> FeistelPermutation:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, FeistelPermutation(self.n, (self.seed << 32) ^ epoch))
        return self._perm[1]

    def sample(self, index: int) -> torch.Tensor:
        """Return sample ``index`` (LongTensor of length ``seq_len + 1``)."""
        if index < 0:
            raise ValueError(f"sample index must be >= 0, got {index}")
        epoch, offset = divmod(index, self.n)
        return self.windows.window(self.lo + self._permutation(epoch)(offset))

    def __repr__(self) -> str:
        return f"ShuffledWindows({self.windows!r}, windows [{self.lo}, {self.lo + self.n}), seed={self.seed})"
