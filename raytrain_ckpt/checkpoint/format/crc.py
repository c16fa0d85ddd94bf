"""CRC-32C arithmetic: the checksum of a memory region from the checksums taken while writing it.

A writer that streams a staging buffer's bytes into files checksums every chunk as it goes
(the files' CRC-32C). The same chunks are most of the buffer, so the buffer's own CRC-32C
(what a restart from memory checks, ``memcopy.CommittedCopy.crc32c``) follows from them
without reading the buffer again: CRC-32C is linear over GF(2), so

    crc(A + B) = crc(A) * x^(8 |B|) mod P  xor  crc(B)

where ``crc(A + B)`` is what ``crc32c(B, crc(A))`` returns. A chunk recorded as (the file's CRC
before it, the file's CRC after it) therefore has the CRC of its own bytes
``after xor before * x^(8 |chunk|)``, and chunks in buffer order chain into the buffer's CRC.
The arithmetic is zlib's ``crc32_combine`` (multiplication modulo the reflected polynomial)
for the Castagnoli polynomial; bytes no chunk covered (alignment padding, a slot DCP
deduplicated to another rank) are checksummed directly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import NamedTuple

import crc32c as _crc32c
import numpy as np

__all__ = ["Span", "address_of", "combine", "region_crc"]

_POLY = 0x82F63B78
"""CRC-32C's polynomial, bit-reflected (the form the byte-wise algorithm uses)."""


class Span(NamedTuple):
    """``length`` bytes at memory ``address`` that went into a file whose CRC-32C was
    ``before`` ahead of them and ``after`` behind them."""

    address: int
    length: int
    before: int
    after: int


def address_of(view: memoryview) -> int:
    """The memory address of ``view``'s first byte: how spans and regions name their bytes."""
    return np.frombuffer(view, np.uint8).ctypes.data


def _multiply(a: int, b: int) -> int:
    """a * b modulo P, both polynomials reflected (bit 31 is x^0)."""
    m, product = 1 << 31, 0
    while a:
        if a & m:
            product ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _squares() -> list[int]:
    """x^(2^k) mod P for k = 0..31 (x^1 is bit 30 when reflected)."""
    table = [1 << 30]
    for _ in range(31):
        table.append(_multiply(table[-1], table[-1]))
    return table


_X2K = _squares()


@functools.lru_cache(maxsize=256)
def _shift(length: int) -> int:
    """x^(8 * length) mod P: multiplying a CRC by it appends ``length`` zero bytes' worth of shift."""
    product, k, n = 1 << 31, 3, length  # x^0; 8 * length = length << 3
    while n:
        if n & 1:
            product = _multiply(_X2K[k & 31], product)
        n >>= 1
        k += 1
    return product


def combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32C of A followed by B from crc(A), crc(B) and B's length."""
    return _multiply(_shift(length_b), crc_a) ^ crc_b


def region_crc(region: memoryview, address: int, spans: Iterable[Span]) -> int:
    """The CRC-32C of ``region`` (whose first byte is at memory ``address``), taking the bytes of
    every span inside it from the span's recorded checksums and reading only the rest.

    Spans outside the region are ignored; where spans overlap, the first one (by address) counts.
    The caller guarantees the spans' bytes have not changed since they were checksummed.
    """
    end = address + len(region)
    inside = sorted(s for s in spans if address <= s.address and s.address + s.length <= end)
    crc, pos = 0, 0
    for span in inside:
        offset = span.address - address
        if offset < pos:
            continue  # bytes already covered by an earlier span
        if offset > pos:
            crc = _crc32c.crc32c(region[pos:offset], crc)
        # combine(crc, crc of the span's own bytes) with the span's own CRC folded in: linear in both
        crc = _multiply(_shift(span.length), crc ^ span.before) ^ span.after
        pos = offset + span.length
    if pos < len(region):
        crc = _crc32c.crc32c(region[pos:], crc)
    return crc
