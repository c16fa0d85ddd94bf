"""Property-based: whatever JSON a manifest holds, parsing and verifying a real step directory
raise nothing but InvalidCheckpoint, and no manifest naming a path outside the step directory is
ever valid."""

from __future__ import annotations

import json
import tempfile
import zlib
from pathlib import Path

import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint

from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from tests.unit.test_checkpoint_layout import _commit

_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)


def _near(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly well-typed values, sometimes anything."""
    return st.one_of(valid, valid, json_values)


file_names = st.one_of(st.sampled_from([".metadata", "__0_0.distcp", "__1_0.distcp", "../outside", "/etc/passwd",
                                        "..", ".", "", "sub/x", "a\x00b", MANIFEST]), st.text(max_size=12))
file_entries = _near(st.fixed_dictionaries(
    {"size": _near(st.integers(-2, 2000))},
    optional={"crc32c": _near(st.integers(-1, 1 << 33)), "crc32": _near(st.integers(-1, 1 << 33))}))
manifests = st.fixed_dictionaries(
    {"step": _near(st.integers(-1, 12)), "world_size": _near(st.integers(0, 4)), "dp_size": _near(st.integers(0, 4)),
     "spec_hash": _near(st.text(max_size=8)),
     "files": _near(st.dictionaries(file_names, file_entries, max_size=4))},
    optional={"format": _near(st.sampled_from([0, 1, 2, 3])), "pp_size": _near(st.integers(0, 3)),
              "wall": _near(st.dictionaries(st.text(max_size=8), st.floats(allow_nan=False), max_size=3)),
              "model": json_values, "samples_seen": _near(st.integers(-1, 10)), "created_unix": json_values})


@_SETTINGS
@given(json_values)
def test_any_json_parses_to_a_manifest_or_invalid_checkpoint(data: object) -> None:
    try:
        Manifest.from_json(json.dumps(data))
    except InvalidCheckpoint:
        pass


@_SETTINGS
@given(st.one_of(manifests, json_values))
def test_verify_of_a_real_step_raises_only_invalid_checkpoint(data: object) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        layout = CheckpointLayout(Path(tmp))
        step_dir = _commit(layout, 3)
        (Path(tmp) / "outside").write_bytes(b"x" * 10)
        (step_dir / MANIFEST).write_text(json.dumps(data))
        for level in ("size", "checksum"):
            try:
                manifest = layout.verify(step_dir, level)
            except InvalidCheckpoint:
                continue
            for name in manifest.files:
                assert (step_dir / name).resolve().parent == step_dir.resolve(), name


def _plant(root: Path, step_dir: Path, name: str) -> None:
    """Put a 1-byte file where ``name`` points, when that is inside the test's directory: a real escape."""
    try:
        target = (step_dir / name).resolve()
        if target.is_relative_to(root.resolve()) and target != step_dir.resolve() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(b"x")
    except (OSError, ValueError):
        pass  # a name the file system cannot hold: nothing to plant, the manifest is still checked


@_SETTINGS
@given(st.text(min_size=0, max_size=16).filter(lambda n: "/" in n or n in ("", ".", "..") or "\x00" in n)
       | st.builds(lambda a, b: f"{a}/{b}", st.text(max_size=6), st.text(max_size=6))
       | st.sampled_from(["..", "../outside", "../../etc/passwd", "/abs", "./x", "sub/x"]))
def test_a_manifest_naming_a_path_outside_the_step_dir_is_never_valid(name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        layout = CheckpointLayout(Path(tmp))
        step_dir = _commit(layout, 3)
        _plant(Path(tmp), step_dir, name)
        data = json.loads((step_dir / MANIFEST).read_text())
        data["files"][name] = {"size": 1, "crc32c": crc32c.crc32c(b"x"), "crc32": zlib.crc32(b"x")}
        (step_dir / MANIFEST).write_text(json.dumps(data))
        try:
            layout.verify(step_dir, "checksum")
        except InvalidCheckpoint:
            return
        raise AssertionError(f"a manifest naming {name!r} verified")
