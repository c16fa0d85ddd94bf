"""A pickle that differs from a passed one only in its atoms gets the full pre-scan's verdict
without the scan (``checkpoint/format/scandiff.py``), and anything else is scanned in full.

The proof is differential: thousands of files derived from a passed ``.metadata`` (atoms replaced
by atoms of other lengths, frames moved, added, dropped, atoms replaced by references and marks,
shared nests spliced in, bytes flipped, inserted, cut) are judged by ``PassedScans`` primed with
the original and by ``scan_pickle`` alone: the verdicts (pass, or the refusal's message) must be
the same for every file. The positions of the opcodes come from ``pickletools``, not from the
walker under test.
"""

from __future__ import annotations

import pickle
import pickletools
import random
import struct

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.prescan import PickleBudget, scan_pickle
from raytrain_ckpt.checkpoint.format.scandiff import PassedScans
from tests.unit.test_bounded_reads import _shared_nest

_ATOMS = {"BININT1", "BININT2", "BININT", "LONG1", "SHORT_BINUNICODE", "BINUNICODE", "SHORT_BINBYTES", "BINBYTES",
          "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE", "GLOBAL"}


def _metadata(tensors: int, step: int = 1, shift: int = 0) -> Metadata:
    """DCP ``Metadata`` of ``tensors`` tensors in 4 chunks each and as many byte items, as a save
    of ``step`` writes it (``shift`` moves every byte item's offset)."""
    entries, storage = {}, {}
    for t in range(tensors):
        chunks = [ChunkStorageMetadata(offsets=torch.Size([64 * r, 0]), sizes=torch.Size([64, 128])) for r in range(4)]
        entries[f"model.layers.{t}.weight"] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.bfloat16), size=torch.Size([256, 128]), chunks=chunks)
        for r in range(4):
            storage[MetadataIndex(f"model.layers.{t}.weight", torch.Size([64 * r, 0]))] = _StorageInfo(
                relative_path=f"__{r}_0.distcp", offset=t * 16384, length=16384)
        entries[f"extra.{t}"] = BytesStorageMetadata()
        storage[MetadataIndex(f"extra.{t}")] = _StorageInfo(relative_path="__0_0.distcp",
                                                          offset=10 ** 6 + t * 97 + shift, length=97 + t % 3)
    return Metadata(state_dict_metadata=entries, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=f"/ckpt/job/step-{step:08d}", save_id=f"save-{step}"))


def _verdict(scan, data: bytes) -> str | None:
    try:
        scan(data)
    except InvalidCheckpoint as exc:
        return str(exc)
    return None


def _atom(rng: random.Random) -> bytes:
    """One atom opcode with its argument, of a random kind and length."""
    kind = rng.randrange(12)
    if kind == 0:
        return b"K" + bytes([rng.randrange(256)])
    if kind == 1:
        return b"M" + struct.pack("<H", rng.randrange(1 << 16))
    if kind == 2:
        return b"J" + struct.pack("<i", rng.randrange(-(1 << 31), 1 << 31))
    if kind == 3:
        text = bytes(rng.randrange(97, 123) for _ in range(rng.randrange(0, 40)))
        return b"\x8c" + bytes([len(text)]) + text
    if kind == 4:
        return b"G" + struct.pack(">d", rng.random())
    if kind == 5:
        return rng.choice([b"N", b"\x88", b"\x89"])
    if kind == 6:
        n = rng.randrange(0, 12)
        return b"\x8a" + bytes([n]) + bytes(rng.randrange(256) for _ in range(n))
    if kind == 7:
        return b"X" + struct.pack("<I", 3) + b"abc"
    if kind == 8:
        return b"I" + str(rng.randrange(-99999, 99999)).encode() + b"\n"  # a line atom
    if kind == 9:
        return b"ctorch\nSize\n"  # a global's name: an atom to the scan
    if kind == 10:
        return b"\x8d" + struct.pack("<Q", 2) + b"ab"  # an 8-byte length
    return b"\x97"  # NEXT_BUFFER


def _derive(data: bytes, ops: list, rng: random.Random) -> bytes:
    """``data`` with a few of its opcodes replaced (mostly atoms by atoms), frames moved, or bytes hit."""
    out = bytearray(data)
    edits = sorted(rng.sample(range(len(ops)), min(len(ops), rng.randrange(1, 6))), reverse=True)
    for k in edits:  # from the end, so earlier positions still hold
        name, start, end = ops[k]
        what = rng.random()
        if name in _ATOMS and what < 0.7:
            out[start:end] = _atom(rng)
        elif name == "FRAME" and what < 0.5:
            del out[start:end]  # a frame the new file does not have
        elif what < 0.75:
            out[start:start] = b"\x95" + struct.pack("<Q", rng.randrange(1 << 20))  # a frame it adds
        elif what < 0.85:
            out[start:end] = rng.choice([b"h\x01", b"(", b"]", b")", b"0", b"2", _shared_nest(rng.randrange(1, 40)),
                                         b"\x94", b"e", b"q\x07", b"\x00"])
        elif what < 0.95:
            out[rng.randrange(start, end)] = rng.randrange(256)
        else:
            del out[rng.randrange(start, end):]
    if rng.random() < 0.1:
        out += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))  # after STOP: never read
    return bytes(out)


def _opcodes(data: bytes) -> list:
    found = list(pickletools.genops(data))
    ends = [pos for _, _, pos in found[1:]] + [len(data)]
    return [(op.name, pos, end) for (op, _, pos), end in zip(found, ends)]


@pytest.mark.parametrize("protocol,tensors,cases", [(2, 12, 400), (4, 12, 400), (4, 220, 40)],
                         ids=["protocol2-small", "protocol4-small", "protocol4-framed"])
def test_a_passed_scan_carried_over_is_the_full_scans_verdict_on_derived_files(protocol, tensors, cases):
    rng = random.Random(f"{protocol}-{tensors}")
    original = pickle.dumps(_metadata(tensors), protocol=protocol)
    if tensors > 100:
        assert len(original) > 2 * (64 << 10), "the framed case needs several frames"
    ops = _opcodes(original)
    budget = PickleBudget(max_expanded=20_000 * (1 + tensors // 12), max_depth=30)  # spliced nests go over
    carried = refused = 0
    primed = PassedScans()
    primed.scan(original, "f", budget)
    for case in range(cases):
        derived = _derive(original, ops, rng)
        scans = PassedScans(full_scans=1, _passed=list(primed._passed))  # as primed, the scan not rerun
        got = _verdict(lambda d: scans.scan(d, "f", budget), derived)
        want = _verdict(lambda d: scan_pickle(d, "f", budget), derived)
        assert got == want, (case, derived)
        carried += scans.full_scans == 1
        refused += want is not None
    # both kinds are there in numbers: files the comparison proved alike, files the scan refused
    assert carried > cases // 5 and refused > cases // 20, (carried, refused)


def test_the_saves_of_one_job_are_scanned_once():
    scans = PassedScans()
    for step in range(1, 40):  # the save's id and path grow longer, byte items move by any amount
        data = pickle.dumps(_metadata(150, step=step * 37, shift=step ** 4))
        scans.scan(data, f"step {step}")
    assert scans.full_scans == 1


def test_a_nest_in_place_of_an_atom_is_refused_as_the_full_scan_refuses_it():
    original = pickle.dumps(_metadata(12), protocol=2)
    strings = ("SHORT_BINUNICODE", "BINUNICODE")
    name, start, end = next(op for op in _opcodes(original) if op[0] in strings and op[1] > 200)
    hostile = original[:start] + _shared_nest(60) + original[end:]
    scans = PassedScans()
    scans.scan(original, "f")
    with pytest.raises(InvalidCheckpoint) as caught:
        scans.scan(hostile, "f")
    with pytest.raises(InvalidCheckpoint) as alone:
        scan_pickle(hostile, "f")
    assert str(caught.value) == str(alone.value) and "over" in str(caught.value)
    assert scans.full_scans == 2


def test_a_file_unlike_any_passed_one_is_scanned_and_the_comparison_gives_up_early():
    rng = random.Random(7)
    original = pickle.dumps(_metadata(40), protocol=2)
    scans = PassedScans()
    scans.scan(original, "f")
    ops = _opcodes(original)
    # every atom replaced: alike for the scan, but more differences than comparing is worth
    out = bytearray(original)
    for name, start, end in reversed(ops):
        if name in _ATOMS and name != "GLOBAL":
            out[start:end] = _atom(rng)
    scans.scan(bytes(out), "f")
    assert scans.full_scans == 2
    scan_pickle(bytes(out), "f")  # (it passes: the scan ran, not the comparison)


def test_frames_a_file_adds_count_against_the_opcode_budget():
    original = pickle.dumps(_metadata(12), protocol=4)
    _, ops = scan_pickle(original, "f")
    budget = PickleBudget(max_opcodes=ops + 1)
    start = next(pos for name, pos, _ in _opcodes(original) if name == "BINUNICODE" or name == "SHORT_BINUNICODE")
    frame = b"\x95" + struct.pack("<Q", 9)
    scans = PassedScans()
    scans.scan(original, "f", budget)
    scans.scan(original[:start] + frame + original[start:], "f", budget)  # one more opcode: within
    assert scans.full_scans == 1
    two_more = original[:start] + frame + frame + original[start:]
    with pytest.raises(InvalidCheckpoint, match=f"run over {ops + 1} opcodes"):
        scans.scan(two_more, "f", budget)
    with pytest.raises(InvalidCheckpoint, match=f"run over {ops + 1} opcodes"):
        scan_pickle(two_more, "f", budget)


def test_a_raised_budget_is_applied_once(monkeypatch):
    from raytrain_ckpt.checkpoint.format.prescan import BUDGET_ENV

    monkeypatch.setenv(BUDGET_ENV, "2")
    many = b"\x80\x02(" + b"N" * 300 + b"t."  # 302 opcodes: over 2 x 100, under 4 x 100
    with pytest.raises(InvalidCheckpoint, match="run over 200 opcodes"):
        PassedScans().scan(many, "f", PickleBudget(max_opcodes=100))
    nest = b"\x80\x02N" + b"".join(b"\x94h" + bytes([i]) + b"\x86" for i in range(26)) + b"."
    with pytest.raises(InvalidCheckpoint, match="over 100000000 nodes"):  # 2^27 nodes: over 2 x 50 M
        PassedScans().scan(nest, "f")
