"""Index-addressed token sources.

Every source maps a GLOBAL sample index to a fixed token sequence: sample ``i``
depends only on (source contents, seed, i). Nothing depends on the world size
or on how many samples were drawn before, so training can resume at any index
with any data-parallel size and see exactly the same data.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from raytrain_ckpt.data.suffixes import TEXT_SUFFIXES, input_files

logger = logging.getLogger(__name__)

__all__ = ["TEXT_SUFFIXES", "ByteTextTokens", "SyntheticTokens", "TokenSource", "build_source"]

_MASK64 = (1 << 64) - 1
_SEPARATOR = b"\n"
# Strides of the synthetic progressions stay small so that even a bigram
# model gains a lot over uniform: the loss drops visibly within a few steps.
_MAX_STRIDE = 8


def _mix64(*values: int) -> int:
    """Stable 64-bit hash of a tuple of ints (splitmix64 finaliser chained).

    Python's ``hash()`` is salted per process for some types and not a
    contract, so it cannot address data reproducibly across workers.
    """
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state


def _generator(*values: int) -> torch.Generator:
    """A CPU generator seeded from a stable hash of ``values``."""
    gen = torch.Generator()
    # manual_seed wants a value that fits in a signed 64-bit int.
    gen.manual_seed(_mix64(*values) >> 1)
    return gen


@runtime_checkable
class TokenSource(Protocol):
    """A deterministic, index-addressed sequence of token samples.

    Attributes:
        vocab_size: Every token id is in ``[0, vocab_size)``.
        seq_len: Model sequence length; samples hold ``seq_len + 1`` tokens.
    """

    vocab_size: int
    seq_len: int

    def sample(self, index: int) -> torch.Tensor:
        """Return sample ``index`` as a LongTensor of length ``seq_len + 1``."""
        ...


def _check_common(seq_len: int) -> None:
    """Validate a sequence length shared by all sources."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")


def _check_index(index: int) -> None:
    """Reject negative sample indices, which have no meaning here."""
    if index < 0:
        raise ValueError(f"sample index must be >= 0, got {index}")


class SyntheticTokens:
    """Learnable synthetic data: arithmetic progressions modulo the vocabulary.

    Sample ``i`` is ``(a + b * t) % vocab_size`` for ``t = 0..seq_len`` where
    ``a`` and the small stride ``b`` are drawn from a generator seeded by a
    stable hash of ``(seed, i)``. After two tokens the rest is predictable, so
    the loss of even a tiny model falls quickly.

    Args:
        vocab_size: Number of token ids (at least 2).
        seq_len: Model sequence length.
        seed: Data seed.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        _check_common(seq_len)
        if vocab_size < 2:
            raise ValueError(f"synthetic data needs vocab_size >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self._max_stride = min(_MAX_STRIDE, vocab_size - 1)

    def sample(self, index: int) -> torch.Tensor:
        """Return sample ``index`` (LongTensor of length ``seq_len + 1``)."""
        _check_index(index)
        gen = _generator(self.seed, index)
        start = int(torch.randint(0, self.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, self.max_stride + 1, (1,), generator=gen))
        steps = torch.arange(self.seq_len + 1, dtype=torch.long)
        return (start + stride * steps) % self.vocab_size

    @property
    def max_stride(self) -> int:
        """Largest progression stride used by this source."""
        return self._max_stride

    def __repr__(self) -> str:
        return f"SyntheticTokens(vocab_size={self.vocab_size}, seq_len={self.seq_len}, seed={self.seed})"


def _list_text_files(path: Path) -> list[Path]:
    """Return the corpus files: ``path`` itself or text files below it, sorted."""
    if not path.exists():
        raise ValueError(f"text data path {str(path)!r} does not exist")
    if path.is_file():
        return [path]
    files = input_files(path, TEXT_SUFFIXES)
    if not files:
        raise ValueError(
            f"text data directory {str(path)!r} has no files with suffix in "
            f"{sorted(TEXT_SUFFIXES)}"
        )
    return files


def _read_corpus(files: list[Path]) -> bytearray:
    """Concatenate the non-empty files, separated by a newline byte."""
    parts = [data for data in (f.read_bytes() for f in files) if data]
    return bytearray(_SEPARATOR.join(parts))


class ByteTextTokens:
    """Byte-level tokens (vocab 256) from a text file or a directory of them.

    The corpus is cut into ``W`` windows of ``seq_len + 1`` bytes at stride
    ``seq_len`` (consecutive windows share one byte so every byte is a target
    once). Sample ``i`` belongs to epoch ``e = i // W`` and is window
    ``perm_e[i % W]``, where ``perm_e`` is a permutation seeded by ``(seed, e)``.

    Args:
        path: A file, or a directory searched recursively for files whose
            suffix is in ``TEXT_SUFFIXES``.
        seq_len: Model sequence length.
        seed: Data seed (shuffle order).

    Raises:
        ValueError: If the path is missing, holds no text, or the corpus is
            shorter than ``seq_len + 1`` bytes.
    """

    vocab_size: int = 256

    def __init__(self, path: Path, seq_len: int, seed: int) -> None:
        _check_common(seq_len)
        self.path = Path(path)
        self.seq_len = seq_len
        self.seed = seed
        self._buffer = _read_corpus(_list_text_files(self.path))
        if len(self._buffer) < seq_len + 1:
            raise ValueError(
                f"text corpus at {str(self.path)!r} has {len(self._buffer)} bytes, fewer than "
                f"seq_len + 1 = {seq_len + 1}; add text or lower seq_len"
            )
        # frombuffer shares memory with the bytearray, which we keep alive.
        self._tokens = torch.frombuffer(self._buffer, dtype=torch.uint8)
        self.num_windows = (len(self._buffer) - 1) // seq_len
        self._perm_cache: tuple[int, torch.Tensor] | None = None
        logger.info(
            "text corpus %s: %d bytes, %d windows of %d", self.path, len(self._buffer),
            self.num_windows, seq_len + 1,
        )

    @property
    def num_bytes(self) -> int:
        """Size of the concatenated corpus in bytes."""
        return len(self._buffer)

    def _permutation(self, epoch: int) -> torch.Tensor:
        """Window order of ``epoch``; the most recent one is cached."""
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            perm = torch.randperm(self.num_windows, generator=_generator(self.seed, epoch))
            self._perm_cache = (epoch, perm)
        return self._perm_cache[1]

    def sample(self, index: int) -> torch.Tensor:
        """Return sample ``index`` (LongTensor of length ``seq_len + 1``)."""
        _check_index(index)
        epoch, offset = divmod(index, self.num_windows)
        window = int(self._permutation(epoch)[offset])
        start = window * self.seq_len
        return self._tokens[start : start + self.seq_len + 1].to(torch.long)

    def __repr__(self) -> str:
        return f"ByteTextTokens(path={str(self.path)!r}, seq_len={self.seq_len}, seed={self.seed})"


def build_source(
    kind: str, *, seq_len: int, seed: int, vocab_size: int, path: Path | None
) -> TokenSource:
    """Build a token source from spec fields.

    Args:
        kind: ``"synthetic"`` or ``"text"``.
        seq_len: Model sequence length.
        seed: Data seed.
        vocab_size: The model's vocabulary size; synthetic data uses all of
            it, text data needs at least 256 (byte tokens).
        path: Corpus file or directory; required for ``"text"``.

    Returns:
        The source.

    Raises:
        ValueError: For an unknown kind, a missing path or a vocabulary too
            small for the data.
    """
    if kind == "synthetic":
        return SyntheticTokens(vocab_size=vocab_size, seq_len=seq_len, seed=seed)
    if kind == "text":
        if path is None:
            raise ValueError("data kind 'text' needs a path to a text file or directory")
        if vocab_size < ByteTextTokens.vocab_size:
            raise ValueError(
                f"data kind 'text' produces byte tokens 0..255 but the model vocab_size is "
                f"{vocab_size}; use vocab_size >= 256"
            )
        return ByteTextTokens(Path(path), seq_len=seq_len, seed=seed)
    raise ValueError(f"unknown data kind {kind!r}; expected 'synthetic' or 'text'")
