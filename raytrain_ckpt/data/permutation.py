"""A keyed permutation of ``range(n)`` that is computed per index, never materialised.

Shuffling a corpus of billions of windows with ``randperm`` would hold the whole permutation
in memory. A Feistel network over the smallest power-of-four domain that covers ``n``, with
cycle walking to stay inside ``[0, n)``, is a bijection evaluated in O(rounds) per index, so
sample ``i`` of any epoch is found without looking at any other.
"""

from __future__ import annotations

__all__ = ["FeistelPermutation"]

_MASK64 = (1 << 64) - 1
_ROUNDS = 6


def _round_key(key: int, r: int, value: int) -> int:
    """splitmix64 of (key, round, value): the Feistel round function."""
    z = (key + 0x9E3779B97F4A7C15 * (r + 1) + value * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class FeistelPermutation:
    """A bijection of ``range(n)`` keyed by ``key``.

    Args:
        n: Domain size (>= 1).
        key: Any non-negative int; different keys give unrelated orders.
    """

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"permutation domain must be >= 1, got {n}")
        self.n = n
        self.key = key & _MASK64
        # Balanced halves of `half` bits each: the domain 4**half is < 4 * n, so cycle
        # walking takes fewer than 4 rounds of the network on average.
        self._half = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = (1 << self._half) - 1

    def _encrypt(self, x: int) -> int:
        left, right = x >> self._half, x & self._mask
        for r in range(_ROUNDS):
            left, right = right, left ^ (_round_key(self.key, r, right) & self._mask)
        return (left << self._half) | right

    def __call__(self, index: int) -> int:
        """The image of ``index`` (0 <= index < n)."""
        if not 0 <= index < self.n:
            raise ValueError(f"index {index} outside the permutation domain [0, {self.n})")
        x = self._encrypt(index)
        while x >= self.n:
            x = self._encrypt(x)
        return x
