"""A tensor chunk whose blob reads as one parsed before gets that parse's header without a parse
(``tensorblob.ChunkParses``), and any other blob is parsed: differential against the parse alone."""

from __future__ import annotations

import io
import random

import pytest
import torch

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.tensorblob import ChunkParses, FileSlice, parse_chunk


def _blob(tensor: torch.Tensor) -> bytes:
    """A chunk as the writer saves it: ``torch.save`` without the zip records' CRC-32
    (``checkpoint/datapath/filewrite.py``; with it, the central directory holds a CRC of the tensor
    bytes and every chunk of other values reads as a new blob: parsed, as before)."""
    buf = io.BytesIO()
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(tensor, buf)
    finally:
        torch.serialization.set_crc32_options(crc)
    return buf.getvalue()


def _verdict(parse, data: bytes):
    try:
        return parse(FileSlice(io.BytesIO(data), 0, len(data)))
    except InvalidCheckpoint as exc:
        return str(exc)


def test_the_chunks_of_one_layout_are_parsed_once_and_get_their_own_header():
    blobs = [_blob(torch.randn(64, 32)) for _ in range(20)] + [_blob(torch.randn(8, 4).t()) for _ in range(5)]
    data = b"".join(blobs)
    parses = ChunkParses()
    f, at = io.BytesIO(data), 0
    for blob in blobs:
        header = parses.parse(FileSlice(f, at, len(blob)), "c")
        assert header == parse_chunk(io.BytesIO(blob), "c")  # (a BytesIO: parsed, never remembered)
        at += len(blob)
    assert parses.full_parses == 2


def _mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(len(out))
        what = rng.random()
        if what < 0.6:
            out[at] = rng.randrange(256)
        elif what < 0.75:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        elif what < 0.9:
            del out[at:at + rng.randrange(1, 8)]
        else:
            del out[at:]
    return bytes(out)


@pytest.mark.parametrize("shape", [(64, 16), (3, 50, 7)])
def test_a_remembered_parse_is_the_parses_own_verdict_on_mutated_blobs(shape):
    rng = random.Random(str(shape))
    original = _blob(torch.randn(*shape))
    primed = ChunkParses()
    _verdict(lambda f: primed.parse(f, "c"), original)
    carried = refused = 0
    for case in range(600):
        derived = _mutate(original, rng)
        parses = ChunkParses()
        parses._headers, parses._patterns = dict(primed._headers), {n: list(p) for n, p in primed._patterns.items()}
        got = _verdict(lambda f: parses.parse(f, "c"), derived)
        want = _verdict(lambda f: ChunkParses(entries=0, max_trace=-1).parse(f, "c"), derived)
        assert got == want, (case, derived)
        carried += parses.full_parses == 0
        refused += isinstance(want, str)
    # both kinds in numbers: blobs changed only in their tensor bytes, blobs the parse refused
    assert carried > 100 and refused > 50, (carried, refused)


def test_a_remembered_parse_is_bounded():
    parses = ChunkParses(entries=8, shapes=2)
    for n in range(1, 30):
        blob = _blob(torch.zeros(n))
        parses.parse(FileSlice(io.BytesIO(blob), 0, len(blob)), "c")
    assert len(parses._headers) <= 8 and all(len(p) <= 2 for p in parses._patterns.values())


def test_a_record_of_a_zip_version_zipfile_does_not_read_is_refused_not_raised():
    blob = bytearray(_blob(torch.zeros(4)))
    at = blob.index(b"PK\x01\x02")  # the first central directory record: "version needed" at +6
    blob[at + 6:at + 8] = b"\xff\x00"
    with pytest.raises(InvalidCheckpoint, match="not a torch.save blob"):
        parse_chunk(io.BytesIO(bytes(blob)), "c")


def test_a_parse_that_read_short_is_not_kept():
    """A file shorter than its slice (a manifest whose sizes lie) reads short: kept, its trace would
    match a complete blob whose own parse reads other bytes (its real end record) and refuses."""
    short = _blob(torch.arange(6.0))
    n = len(short) + 64
    complete = short + b"PK\x05\x06" + b"\xff" * 60
    parses = ChunkParses()
    parses.parse(FileSlice(io.BytesIO(short), 0, n), "short")
    with pytest.raises(InvalidCheckpoint, match="not a torch.save blob"):
        parses.parse(FileSlice(io.BytesIO(complete), 0, n), "complete")
    assert parses.full_parses == 2


def test_reads_at_a_pattern_are_the_bytes_each_read_alone_returns():
    """``FileSlice.read_at`` reads neighbouring reads as one span and cuts each out: the same
    bytes as one read each, for reads near and far apart (past the span gap), overlapping, at the
    slice's end and past it, and in a file shorter than its slice (a manifest's sizes that lie)."""
    import random

    rng = random.Random(5)
    data = bytes(rng.randrange(256) for _ in range(300_000))
    for offset, length, cut in ((0, len(data), len(data)), (1000, 250_000, len(data)), (5000, 250_000, 120_000)):
        f = io.BytesIO(data[:cut])
        for _ in range(200):
            pattern = tuple((rng.choice([rng.randrange(length + 50), rng.randrange(64), length - rng.randrange(100)]),
                             rng.choice([0, 1, 4, 30, 22, 46, 70_000])) for _ in range(rng.randrange(1, 10)))
            alone = []
            for pos, n in pattern:
                s = FileSlice(f, offset, length)
                s.seek(pos)
                alone.append(s.read(n))
            assert FileSlice(f, offset, length).read_at(pattern) == tuple(alone), pattern


def _file_verdict(parse_file, data: bytes, chunks: list[tuple[int, int]]):
    try:
        parse_file(io.BytesIO(data), chunks, lambda at: f"c at {at}")
        return None
    except InvalidCheckpoint as exc:
        return str(exc)


def test_a_file_confirmed_at_once_is_the_chunk_by_chunk_verdict_on_mutated_files():
    """``ChunkParses.parse_file`` confirms a file whose chunks' header bytes are those of a file it
    confirmed before in one read and one comparison: differential against parsing every chunk
    alone with nothing remembered, on files whose tensor bytes, headers, lengths and ends are
    mutated (a file read short, a chunk list that no longer fits the bytes)."""
    rng = random.Random(11)
    blobs = [_blob(torch.randn(16, 8)) for _ in range(6)] + [_blob(torch.randn(5, 3).t()) for _ in range(3)]
    chunks, at = [], 0
    for blob in blobs:
        chunks.append((at, len(blob)))
        at += len(blob)
    original = b"".join(blobs)
    primed = ChunkParses()
    assert _file_verdict(primed.parse_file, original, chunks) is None
    assert primed._files, "the file's reads were not kept"
    fresh = ChunkParses(entries=0, max_trace=-1)
    carried = refused = 0
    for case in range(400):
        # another step's file (new tensor bytes, the same headers), or the original's bytes mutated
        derived = _mutate(original, rng) if rng.random() < 0.6 else b"".join(
            [_blob(torch.randn(16, 8)) for _ in range(6)] + [_blob(torch.randn(5, 3).t()) for _ in range(3)])
        parses = ChunkParses()
        parses._files = dict(primed._files)  # the file's reads only: any chunk it must parse is parsed
        got = _file_verdict(parses.parse_file, derived, chunks)
        want = _file_verdict(fresh.parse_file, derived, chunks)
        assert got == want, case
        carried += parses.full_parses == 0
        refused += want is not None
    assert carried > 50 and refused > 50, (carried, refused)
    again = ChunkParses()
    again._files = dict(primed._files)
    assert _file_verdict(again.parse_file, original, chunks) is None and again.full_parses == 0
    short = original[:chunks[-1][0] + 10]  # the last chunk's bytes cut off: parsed, and refused
    assert _file_verdict(again.parse_file, short, chunks) == _file_verdict(fresh.parse_file, short, chunks) is not None


def test_the_kept_reads_of_files_are_bounded():
    parses = ChunkParses(entries=4, max_trace=256)
    for n in range(1, 40):
        blob = _blob(torch.zeros(n))
        parses.parse_file(io.BytesIO(blob), [(0, len(blob))], str)
        assert parses._file_bytes <= 4 * 256


class _Reads(io.BytesIO):
    """A data file that notes the largest single read asked of it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.largest = 0

    def read(self, n: int | None = -1) -> bytes:
        out = super().read(n)
        self.largest = max(self.largest, len(out))
        return out


def _file(nchunks: int, numel: int) -> tuple[bytes, list[tuple[int, int]]]:
    blobs = [_blob(torch.randn(numel)) for _ in range(nchunks)]
    chunks, at = [], 0
    for blob in blobs:
        chunks.append((at, len(blob)))
        at += len(blob)
    return b"".join(blobs), chunks


def test_a_file_confirmed_at_once_is_never_read_whole():
    """Chunks of small tensors lie close together: their reads would merge into one span of the
    whole file (GBs for a data file). No span of the one-read confirmation is longer than 256 KiB."""
    first, chunks = _file(64, 15_000)  # 64 chunks of about 60 KB: 3.9 MB
    second, again = _file(64, 15_000)  # the next step's file of the rank: the same chunk list
    assert chunks == again
    parses = ChunkParses()
    parses.parse_file(_Reads(first), chunks, str)
    g = _Reads(second)
    parses.parse_file(g, chunks, str)
    assert parses.full_parses == 1  # the second file was confirmed at once
    assert 0 < g.largest <= 256 << 10, (g.largest, len(second))


def test_a_file_whose_reads_alone_are_over_the_bound_is_not_kept():
    parses = ChunkParses(entries=4, max_trace=4096)
    data, chunks = _file(40, 1)  # 40 chunks' reads: more than 16 KiB
    parses.parse_file(io.BytesIO(data), chunks, str)
    assert parses._file_bytes <= 4 * 4096 and not parses._files
    parses.parse_file(io.BytesIO(data), chunks[:4], str)  # a small one still is
    assert parses._files and parses._file_bytes <= 4 * 4096
