"""Commit protocol, verification and retention, on real files."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint

from raytrain_ckpt.checkpoint.format.manifest import describe_file, MANIFEST, Manifest
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy

METADATA = pickle.dumps(Metadata(state_dict_metadata={}))
"""A real (empty) DCP ``.metadata``: verification unpickles it with the restricted unpickler."""


def _commit(layout: CheckpointLayout, step: int, payload: bytes = b"x" * 1000) -> Path:
    tmp = layout.new_tmp_dir(step)
    files = {}
    for name, data in (("__0_0.distcp", payload), (".metadata", METADATA)):
        (tmp / name).write_bytes(data)
        files[name] = describe_file(tmp / name)
    return layout.commit(tmp, Manifest(step=step, world_size=2, dp_size=2, spec_hash="h", files=files))


def test_commit_then_verify(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    final = _commit(layout, 10)
    assert final.name == "step-00000010"
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())
    assert layout.verify(final, "checksum").step == 10
    assert list(layout.valid_steps()) == [10]


def _truncate(d: Path) -> None:
    with open(d / "__0_0.distcp", "r+b") as f:
        f.truncate(10)


def _flip_byte(d: Path) -> None:
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[500] ^= 0xFF
    (d / "__0_0.distcp").write_bytes(bytes(data))


def _drop_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def _garble_manifest(d: Path) -> None:
    (d / "manifest.json").write_text("{not json")


def _drop_metadata(d: Path) -> None:
    (d / ".metadata").unlink()


@pytest.mark.parametrize(("damage", "level", "needle"), [
    (_truncate, "size", "truncated"),
    (_flip_byte, "checksum", "CRC-32"),
    (_drop_manifest, "size", "no manifest.json"),
    (_garble_manifest, "size", "unreadable"),
    (_drop_metadata, "size", ".metadata is missing"),
])
def test_damaged_step_is_skipped_and_previous_is_used(tmp_path: Path, damage, level, needle) -> None:
    layout = CheckpointLayout(tmp_path)
    _commit(layout, 10)
    damage(_commit(layout, 20))
    with pytest.raises(InvalidCheckpoint, match=needle):
        layout.verify(layout.step_dir(20), level)
    assert list(layout.valid_steps(level)) == [10]


def test_flipped_byte_passes_size_check_but_not_checksum(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    _flip_byte(_commit(layout, 5))
    assert list(layout.valid_steps("size")) == [5]
    assert list(layout.valid_steps("checksum")) == []


def test_empty_dir_file_and_leftover_tmp(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    _commit(layout, 1)
    (tmp_path / "step-00000002").mkdir()                       # empty step dir
    (tmp_path / "step-00000003").write_text("not a dir")         # a file, not a dir
    leftover = layout.new_tmp_dir(4)
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    assert list(layout.valid_steps()) == [1]
    assert layout.remove_leftover_tmp() == [leftover]
    assert not leftover.exists()
    assert (tmp_path / "step-00000001").is_dir()


def test_manifest_for_another_step_is_invalid(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    os.rename(_commit(layout, 7), tmp_path / "step-00000008")
    assert list(layout.valid_steps()) == []


def test_commit_moves_a_torn_step_aside_but_never_replaces_a_valid_one(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    (tmp_path / "step-00000003").mkdir(parents=True)
    _commit(layout, 3)
    assert list(layout.valid_steps()) == [3]
    assert any(p.name.startswith("step-00000003.invalid-") for p in tmp_path.iterdir())
    with pytest.raises(FileExistsError):
        _commit(layout, 3, payload=b"y" * 1000)
    assert (layout.step_dir(3) / "__0_0.distcp").read_bytes() == b"x" * 1000


def test_delete_leaves_no_torn_step(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    _commit(layout, 1)
    _commit(layout, 2)
    layout.delete(1)
    assert sorted(layout.step_dirs()) == [2]
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]


@pytest.mark.parametrize(("k", "n", "committed", "leased", "in_flight", "expected"), [
    (None, None, [1, 2, 3], [], [], []),                 # keep everything
    (2, None, [], [], [], []),
    (2, None, [10], [], [], []),
    (2, None, [10, 20, 30, 40], [], [], [10, 20]),
    (1, None, [10, 20, 30], [], [], [10, 20]),
    (0, None, [10, 20], [], [], [10]),                  # the newest is never deleted
    (2, 20, [10, 20, 30, 40, 50], [], [], [10, 30]),     # every 20th kept
    (1, None, [10, 20, 30], [10], [], [20]),             # leased kept
    (1, None, [10, 20, 30], [], [20], [10]),             # in flight kept
    (2, None, [30, 10, 20, 20], [], [], [10]),           # unordered, duplicates
])
def test_retention_table(k, n, committed, leased, in_flight, expected) -> None:
    assert RetentionPolicy(k, n).to_delete(committed, leased, in_flight) == expected


def test_manifests_written_before_pipelining_read_as_pp_1(tmp_path: Path) -> None:
    path = _commit(CheckpointLayout(tmp_path), 5)
    data = json.loads((path / MANIFEST).read_text())
    assert data["pp_size"] == 1
    del data["pp_size"]  # what an older release wrote
    assert Manifest.from_json(json.dumps(data)).pp_size == 1


@pytest.mark.parametrize(("make", "expected"), [
    (os.mkfifo, "__0_0.distcp is not a regular file (a directory, FIFO, socket or device)"),
    (os.mkdir, "__0_0.distcp is not a regular file (a directory, FIFO, socket or device)"),
    (lambda p: None, "__0_0.distcp is missing"),
])
def test_a_shard_replaced_by_a_special_file_is_named_as_such(tmp_path: Path, make, expected) -> None:
    layout = CheckpointLayout(tmp_path)
    final = _commit(layout, 10)
    (final / "__0_0.distcp").unlink()
    make(final / "__0_0.distcp")
    with pytest.raises(InvalidCheckpoint, match=re.escape(expected)):
        layout.verify(final, "checksum")


def test_a_manifest_larger_than_any_manifest_is_refused_unread(tmp_path: Path) -> None:
    from raytrain_ckpt.checkpoint.format.verify import MAX_MANIFEST_BYTES

    layout = CheckpointLayout(tmp_path)
    final = _commit(layout, 10)
    with open(final / MANIFEST, "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)          # sparse: a file that size, without the disk
    with pytest.raises(InvalidCheckpoint, match=rf"is {MAX_MANIFEST_BYTES + 1} bytes, more than any manifest holds"):
        layout.read_manifest(final)
    assert list(layout.valid_steps()) == []
