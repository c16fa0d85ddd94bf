"""A rank loads a step its job's resume plan verified without decoding ``.metadata`` in a reader
process of its own: the plan's ``ResumePoint`` carries the decode key of the bytes whose check
passed (``unpickling.vouching``), and the rank takes that decode as done (``vouch_for``) for
exactly those bytes; any other bytes are decoded in the reader process first, as before."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.format import scancache
from raytrain_ckpt.checkpoint.format.unpickling import metadata_decode_key, vouching
from raytrain_ckpt.checkpoint.format.verify import verify_step
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from tests.unit.test_paper_cuts import _step

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("level", ["size", "checksum"])
def test_a_check_that_passes_vouches_for_its_bytes_checked_now_or_remembered(tmp_path, monkeypatch, level):
    monkeypatch.setenv(scancache.CACHE_ENV, "0")
    scancache.forget()
    step = _step(tmp_path / "job")
    want = metadata_decode_key((step / ".metadata").read_bytes())
    for _ in range(2):  # checked in the reader process, then (size level) remembered
        with vouching() as keys:
            verify_step(step, level, open_storage(step))
        assert keys == [want]
    with vouching() as keys:  # nothing vouched outside the block's thread, nor for a refusal
        (step / "__0_0.distcp").write_bytes(b"x" * os.path.getsize(step / "__0_0.distcp"))
        with pytest.raises(Exception):
            verify_step(step, "checksum", open_storage(step))
    assert keys == []


def test_the_resume_plan_hands_the_ranks_the_key_of_the_step_it_verified(tmp_path, monkeypatch):
    monkeypatch.setenv(scancache.CACHE_ENV, "0")
    scancache.forget()
    root = tmp_path / "job"
    step = _step(root, 4)
    actor = CheckpointActor(str(root), RetentionPolicy(None))
    for verify in ("size", "checksum", "size"):  # checked, checked with chunks, then remembered
        point = asyncio.run(actor.acquire(f"a-{verify}", "latest", verify))
        assert point is not None and point.step == 4
        assert point.metadata_key == metadata_decode_key((step / ".metadata").read_bytes())
        asyncio.run(actor.release(f"a-{verify}"))


_LOAD = """
import sys
from raytrain_ckpt.checkpoint.format import sandbox, unpickling
from raytrain_ckpt.checkpoint.format.metadata import load_metadata
calls = []
real = sandbox.decode_in_sandbox
sandbox.decode_in_sandbox = lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1]
unpickling.vouch_for(sys.argv[2:])
with open(sys.argv[1], "rb") as f:
    md = load_metadata(f, sys.argv[1])
print(len(calls), sorted(md.state_dict_metadata))
"""


def _load_in_a_fresh_process(path: Path, *keys: str) -> tuple[int, str]:
    env = dict(os.environ, RAYTRAIN_CKPT_SCAN_CACHE="0")
    out = subprocess.run([sys.executable, "-c", _LOAD, str(path), *keys], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    calls, names = out.stdout.strip().split(" ", 1)
    return int(calls), names


def test_a_rank_takes_a_vouched_decode_as_done_for_those_bytes_only(tmp_path):
    step = _step(tmp_path / "job")
    md = step / ".metadata"
    key = metadata_decode_key(md.read_bytes())
    assert _load_in_a_fresh_process(md)[0] == 1  # nothing vouched: decoded in the reader process
    calls, names = _load_in_a_fresh_process(md, key)
    assert calls == 0 and "model.weight" in names
    assert _load_in_a_fresh_process(md, "not-a-key", "0" * 64)[0] == 1  # keys of other bytes vouch nothing
    other = tmp_path / "other.metadata"  # other bytes than those vouched for: decoded first
    data = bytearray(md.read_bytes())
    at = data.index(b"model.bias")
    data[at:at + 10] = b"model.bia2"
    other.write_bytes(bytes(data))
    assert _load_in_a_fresh_process(other, key)[0] == 1
