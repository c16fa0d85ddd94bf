"""Hostile or corrupt checkpoint directories, on real files: nothing in them is executed, and a bad
manifest, a crafted ``.metadata`` or a flipped byte makes that step invalid (never a crash, never
loaded or exported)."""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.interchange.export import export_checkpoint
from raytrain_ckpt.checkpoint.errors import ConversionError
from raytrain_ckpt.checkpoint.interchange.importer import import_checkpoint
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, UnsafeCheckpoint
from raytrain_ckpt.checkpoint.format.manifest import describe_file, file_crc32, MANIFEST, Manifest
from raytrain_ckpt.checkpoint.format.names import EntryKind, parse_entry, step_name
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.format.metadata import SafeFileSystemReader, SafeLoadPlanner
from raytrain_ckpt.cli.main import main
from raytrain_ckpt.report.inventory import scan, verify_step
from raytrain_ckpt.models import build_model
from raytrain_ckpt.spec.sections import CheckpointSpec
from tests.unit.test_checkpoint_layout import _commit


def _real_step(root: Path, step: int = 0) -> Path:
    """A real DCP step (a tiny model imported as a committed step), renamed to ``step``."""
    src = root.parent / f"{root.name}-model.pt"
    torch.manual_seed(step)
    torch.save(build_model("debug", {"n_layers": 1}).state_dict(), src)
    path = import_checkpoint(src, root / f"import-{step}").path
    final = CheckpointLayout(root).step_dir(step)
    data = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**data, "step": step}))
    os.rename(path, final)
    return final


def _rewrite_manifest(step_dir: Path, **changes: object) -> None:
    data = json.loads((step_dir / MANIFEST).read_text())
    (step_dir / MANIFEST).write_text(json.dumps({**data, **changes}))


def _flip_a_shard_byte(step_dir: Path) -> None:
    shard = next(p for p in sorted(step_dir.iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


# --- entry names ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), [
    ("step-00000040", (40, EntryKind.COMMITTED)),
    ("step-123456789", (123456789, EntryKind.COMMITTED)),
    ("step-00000040.tmp-1a2b3c", (40, EntryKind.TMP)),
    ("step-00000040.invalid-deadbeef", (40, EntryKind.INVALID)),
    ("step-00000040.abandoned-0123abcd", (40, EntryKind.ABANDONED)),
    ("step-40", None),                          # not the canonical spelling of step 40
    ("step-000000040", None),
    ("step-00000040.committed-ab", None),
    ("step-00000040.bogus-ab", None),
    ("step-00000040.tmp-", None),
    ("step-00000040.tmp-XYZ", None),
    ("step-00000040/", None),
    ("step-00000040\n", None),
    ("step-0000004\u0660", None),
    ("leases", None),
    ("export-step-00000040", None),
])
def test_parse_entry(name: str, expected: tuple[int, EntryKind] | None) -> None:
    entry = parse_entry(name)
    assert (None if entry is None else (entry.step, entry.kind)) == expected
    if entry is not None:
        assert entry.kind.is_loadable == (entry.kind is EntryKind.COMMITTED)


@pytest.mark.parametrize("kind", list(EntryKind))
def test_step_name_round_trips(kind: EntryKind) -> None:
    entry = parse_entry(step_name(7, kind, "abc123"))
    assert entry is not None and (entry.step, entry.kind) == (7, kind)


def test_a_moved_aside_step_is_listed_and_never_loaded(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    _commit(layout, 1)
    aside = layout.set_aside(_commit(layout, 2), EntryKind.ABANDONED, "a newer step of an abandoned timeline")
    assert aside.name.startswith("step-00000002.abandoned-")
    assert sorted(layout.step_dirs()) == [1] and sorted(layout.valid_steps("checksum")) == [1]
    assert [(r.step, r.status) for r in scan(tmp_path)] == [(1, "valid"), (2, "abandoned")]
    assert verify_step(aside)                 # intact files, but not a committed name
    with pytest.raises(ConversionError, match="abandoned entry, not a committed step"):
        export_checkpoint(aside, tmp_path / "out", "torch", "fp32")


def test_a_step_name_linked_to_another_step_is_judged_by_its_own_name(tmp_path: Path) -> None:
    """``step-00000006`` as a symbolic link to step 2's directory holds step 2's manifest: it is not
    step 6, for export as for verify; the root given through a link of its own still works."""
    root = tmp_path / "job"
    _real_step(root, 2)
    os.symlink(root / "step-00000002", root / "step-00000006")
    with pytest.raises(ConversionError, match="manifest of step 2"):
        export_checkpoint(root / "step-00000006", tmp_path / "out", "torch", "fp32")
    assert verify_step(root / "step-00000006")
    os.symlink(root, tmp_path / "linked-root")
    assert export_checkpoint(tmp_path / "linked-root" / "step-00000002", tmp_path / "out", "torch", "fp32").step == 2


def test_an_export_is_never_written_into_a_step_or_as_a_step_of_a_root(tmp_path: Path) -> None:
    root = tmp_path / "job"
    step = _real_step(root, 2)
    before = {p.name: p.read_bytes() for p in step.iterdir()}
    for out, needle in ((step / "sub", "inside the step directory"), (root / "step-00000008", "would be a step entry")):
        with pytest.raises(ConversionError, match=needle):
            export_checkpoint(root, out, "torch", "fp32")
        assert not out.exists()
    assert {p.name: p.read_bytes() for p in step.iterdir()} == before
    assert [(r.step, r.status) for r in scan(root)] == [(2, "valid")]
    assert export_checkpoint(root, root / "exports" / "latest", "torch", "fp32").step == 2  # beside the steps: fine


# --- the manifest -----------------------------------------------------------------------

_GOOD = {"step": 3, "world_size": 2, "dp_size": 2, "spec_hash": "h",
         "files": {".metadata": {"size": 4, "crc32c": 1}, "__0_0.distcp": {"size": 10, "crc32c": 2}}}


def _with(path: str, value: object) -> dict:
    data = json.loads(json.dumps(_GOOD))
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    node[last] = value
    return data


@pytest.mark.parametrize(("data", "needle"), [
    ([_GOOD], "a JSON list where an object is expected"),
    ("manifest", "a JSON str"),
    (None, "a JSON NoneType"),
    (_with("files", [".metadata"]), "files"),
    (_with("files", {".metadata": 4}), "files..metadata"),
    (_with("files", {".metadata": {"crc32c": 1}}), "size"),
    (_with("step", True), "step"),
    (_with("step", "3"), "step"),
    (_with("step", -1), "step"),
    (_with("step", 3.0), "step"),
    (_with("world_size", 0), "world_size"),
    (_with("spec_hash", 5), "spec_hash"),
    (_with("wall", {"total_s": "fast"}), "wall"),
    (_with("wall", {"total_s": float("inf")}), "wall.total_s: Input should be a finite number"),
    (_with("created_unix", float("nan")), "created_unix: Input should be a finite number"),
    (_with("format", 3), "format"),
    (_with("format", None), "format"),
    ({**_GOOD, "unexpected": 1}, "unexpected"),
    ({k: v for k, v in _GOOD.items() if k != "files"}, "files"),
])
def test_malformed_manifest_is_invalid_with_a_reason(data: object, needle: str) -> None:
    with pytest.raises(InvalidCheckpoint, match=needle.replace(".", r"\.")):
        Manifest.from_json(json.dumps(data))


@pytest.mark.parametrize("entry", [{"crc32c": 1}, {"size": "4", "crc32c": 1}, {"size": -4, "crc32c": 1},
                                   {"size": True, "crc32c": 1}, {"size": 4}, {"size": 4, "crc32c": -1},
                                   {"size": 4, "crc32c": 1 << 32}, {"size": 4, "crc32c": 1, "path": "/x"},
                                   {"size": 4.0, "crc32c": 1}, [4, 1]])
def test_malformed_file_entry_is_invalid(entry: object) -> None:
    with pytest.raises(InvalidCheckpoint, match="files"):
        Manifest.parse(_with("files", {".metadata": entry}))


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "sub/file", "", ".", "..", "a\x00b", "..\\x"])
def test_a_file_name_outside_the_step_dir_is_refused(name: str) -> None:
    with pytest.raises(InvalidCheckpoint, match="not a plain name"):
        Manifest.parse(_with("files", {name: {"size": 1, "crc32c": 0}}))


def test_a_format_1_manifest_with_crc32_stays_readable_and_verifiable(tmp_path: Path) -> None:
    step_dir = _commit(CheckpointLayout(tmp_path), 4)
    files = {p.name: {"size": p.stat().st_size, "crc32": file_crc32(p)} for p in step_dir.iterdir()
             if p.name != MANIFEST}
    _rewrite_manifest(step_dir, format=1, files=files)
    layout = CheckpointLayout(tmp_path)
    assert layout.verify(step_dir, "checksum").files["__0_0.distcp"].checksum[0] == "crc32"
    _flip_a_shard_byte(step_dir)
    with pytest.raises(InvalidCheckpoint, match="fails its CRC-32 check"):
        layout.verify(step_dir, "checksum")


def test_new_manifests_record_crc32c(tmp_path: Path) -> None:
    data = json.loads((_commit(CheckpointLayout(tmp_path), 1) / MANIFEST).read_text())
    assert data["format"] == 2
    assert all(set(e) == {"size", "crc32c"} for e in data["files"].values())


@pytest.mark.parametrize("model", [{"name": 5}, {"name": "debug", "overrides": [1, 2]},
                                   {"name": "debug", "overrides": {"dim": 10 ** 30}}])
def test_a_manifests_model_of_any_shape_is_a_usage_error_of_export(tmp_path: Path, model: object, capsys) -> None:
    """The manifest's ``model`` is data: any shape of it gives one error line and exit 2 (pass --spec)."""
    step = _real_step(tmp_path, 1)
    _rewrite_manifest(step, model=model)
    assert main(["export", str(step), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "the manifest's model" in err and "--spec" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("manifest", [[1, 2], {"step": 2, "files": []}, {**_GOOD, "step": 2, "files": {
    ".metadata": {"size": "4"}}}, {**_GOOD, "step": 2, "files": {"../../outside": {"size": 1, "crc32c": 0}}}])
def test_registry_ls_verify_and_export_survive_a_malformed_manifest(tmp_path: Path, manifest: object) -> None:
    layout = CheckpointLayout(tmp_path)
    _real_step(tmp_path, 1)
    bad = _real_step(tmp_path, 2)
    (bad / MANIFEST).write_text(json.dumps(manifest))
    actor = CheckpointActor(str(tmp_path), RetentionPolicy(None))
    assert asyncio.run(actor.status()).to_dict()["committed"] == [1]
    assert [(r.step, r.status) for r in scan(tmp_path)] == [(1, "valid"), (2, "corrupt")]
    assert verify_step(bad) and "unreadable" in verify_step(bad)[0]
    assert main(["verify", str(bad)]) == 1
    assert main(["ls", str(tmp_path)]) == 0
    with pytest.raises(ConversionError, match="not a valid committed checkpoint"):
        export_checkpoint(bad, tmp_path / "out", "torch", "fp32")
    assert export_checkpoint(tmp_path, tmp_path / "out", "torch", "fp32").step == 1
    assert layout.step_dirs().keys() == {1, 2}           # nothing deleted


# --- a flipped byte ---------------------------------------------------------------------


def test_checksum_verification_is_the_default_on_load() -> None:
    assert CheckpointSpec().verify_on_load == "checksum"


def test_a_flipped_byte_fails_verify_skips_resume_and_refuses_export(tmp_path: Path, capsys) -> None:
    _real_step(tmp_path, 1)
    bad = _real_step(tmp_path, 2)
    _flip_a_shard_byte(bad)
    assert main(["verify", str(bad)]) == 1
    assert "fails its CRC-32C check" in capsys.readouterr().out
    actor = CheckpointActor(str(tmp_path), RetentionPolicy(None))
    point = asyncio.run(actor.acquire("resume", "latest", CheckpointSpec().verify_on_load))
    assert point is not None and point.step == 1
    code = main(["export", str(bad), "--format", "torch", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "fails its CRC-32C check" in err[0], err
    assert not (tmp_path / "out").exists()
    assert (bad / MANIFEST).is_file()                     # refused, never deleted


# --- nothing in a checkpoint is executed ------------------------------------------------


class _RunsCommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


class _RunsPython:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.fixture(params=[_RunsCommand, _RunsPython], ids=["os.system", "builtins.exec"])
def crafted(request, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(checkpoint root, a step whose .metadata runs code when unpickled, the file that code would create).

    The manifest records the crafted file's real size and checksum: only the unpickler stands in the way.
    """
    root, marker = tmp_path / "job", tmp_path / "pwned"
    _real_step(root, 1)
    bad = _real_step(root, 2)
    (bad / ".metadata").write_bytes(pickle.dumps(request.param(marker)))
    files = json.loads((bad / MANIFEST).read_text())["files"]
    _rewrite_manifest(bad, files={**files, ".metadata": describe_file(bad / ".metadata")})
    return root, bad, marker


def test_crafted_metadata_is_refused_by_verify(crafted, capsys) -> None:
    root, bad, marker = crafted
    with pytest.raises(InvalidCheckpoint, match="posix.system|builtins.exec"):
        CheckpointLayout(root).verify(bad, "size")
    assert main(["verify", str(bad)]) == 1
    assert "refusing to unpickle" in capsys.readouterr().out
    assert [(r.step, r.status) for r in scan(root)] == [(1, "valid"), (2, "corrupt")]
    assert not marker.exists()


def test_crafted_metadata_is_refused_by_resume(crafted) -> None:
    root, bad, marker = crafted
    actor = CheckpointActor(str(root), RetentionPolicy(None))
    point = asyncio.run(actor.acquire("resume", "latest", "checksum"))
    assert point is not None and point.step == 1
    # The load path itself (what load_app_state reads first, then loads) refuses too, whatever the registry said.
    with pytest.raises(UnsafeCheckpoint, match="refusing to unpickle"):
        SafeFileSystemReader(str(bad)).read_metadata()
    with pytest.raises(CheckpointException, match="refusing to unpickle"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": {}}, storage_reader=SafeFileSystemReader(str(bad)), planner=SafeLoadPlanner(),
                 no_dist=True)
    assert not marker.exists()


def test_crafted_metadata_is_refused_by_export(crafted, capsys) -> None:
    root, bad, marker = crafted
    with pytest.raises(ConversionError, match="refusing to unpickle"):
        export_checkpoint(bad, root / "out", "torch", "fp32", verify="size")
    assert main(["export", str(bad), "--format", "torch", "--out", str(root / "out2")]) != 0
    assert "refusing to unpickle" in capsys.readouterr().err
    assert not marker.exists()
    assert export_checkpoint(root, root / "out3", "torch", "fp32").step == 1   # the root: the older, intact step


class _BuiltByCall:
    """Pickles as a call of DCP's ``Metadata`` with its fields as arguments (the real class
    applies them; DCP itself never writes this form). ``clear``: a state follows that sets
    ``_called_with`` false (the check's own note that arguments were given)."""

    def __init__(self, md: object, clear: bool = False) -> None:
        self.md, self.clear = md, clear

    def __reduce__(self) -> tuple:
        import dataclasses

        args = tuple(getattr(self.md, f.name) for f in dataclasses.fields(self.md))
        return (type(self.md), args, {"_called_with": False}) if self.clear else (type(self.md), args)


def _point_data_at(step_dir: Path, target: str, by_call: bool = False, clear: bool = False) -> str:
    """Rewrite ``.metadata`` (with real DCP classes only) so that one shard's data is read from
    ``target``; the shard leaves the step and the manifest, which records the new ``.metadata``.
    ``by_call``: the Metadata is rebuilt by a call with arguments. Returns the shard's name."""
    with open(step_dir / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own fresh import: trusted
    shard = next(info.relative_path for info in md.storage_data.values())
    for info in md.storage_data.values():
        if info.relative_path == shard:
            info.relative_path = target
    (step_dir / ".metadata").write_bytes(pickle.dumps(_BuiltByCall(md, clear) if by_call else md))
    files = json.loads((step_dir / MANIFEST).read_text())["files"]
    files.pop(shard)
    _rewrite_manifest(step_dir, files={**files, ".metadata": describe_file(step_dir / ".metadata")})
    return shard


@pytest.mark.parametrize("where", ["outside", "unlisted", "unlisted-by-call", "unlisted-by-call-cleared"])
def test_metadata_that_points_at_unchecked_bytes_is_refused(tmp_path: Path, capsys, where: str) -> None:
    # Every byte a load reads must be a file of the manifest (checksummed): a .metadata that makes
    # DCP read a file outside the step, or one inside it the manifest does not list, is invalid;
    # so is one whose Metadata is built by a call (the check cannot read the fields it passes).
    root = tmp_path / "job"
    _real_step(root, 1)
    bad = _real_step(root, 2)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    if where == "outside":
        shard = _point_data_at(bad, "../../elsewhere/moved.distcp")
        os.rename(bad / shard, outside / "moved.distcp")
    else:
        shard = _point_data_at(bad, "planted.distcp", by_call=where.startswith("unlisted-by-call"),
                               clear=where.endswith("cleared"))
        os.rename(bad / shard, bad / "planted.distcp")
    needle = {"outside": "not a plain name", "unlisted": "does not list",
              "unlisted-by-call": "calling it with arguments",
              "unlisted-by-call-cleared": "calling it with arguments"}[where]
    with pytest.raises(InvalidCheckpoint, match=needle):
        CheckpointLayout(root).verify(bad, "checksum")
    assert main(["verify", str(bad)]) == 1
    assert needle in capsys.readouterr().out
    assert [(r.step, r.status) for r in scan(root)] == [(1, "valid"), (2, "corrupt")]
    point = asyncio.run(CheckpointActor(str(root), RetentionPolicy(None)).acquire("resume", "latest", "checksum"))
    assert point is not None and point.step == 1
    with pytest.raises(ConversionError, match=needle):
        export_checkpoint(bad, root / "out", "torch", "fp32", verify="checksum")
    assert main(["export", str(bad), "--format", "torch", "--out", str(root / "out2")]) == 2
    assert not (root / "out").exists() and not (root / "out2").exists()
    # the load path itself refuses, whatever verified before
    with pytest.raises(InvalidCheckpoint, match="not a plain name" if where == "outside" else "does not list"):
        SafeFileSystemReader(str(bad)).read_metadata()


def test_a_non_tensor_entry_that_runs_code_is_refused_on_load(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"train": {"hook": _RunsCommand(marker), "step": 3}}, checkpoint_id=str(tmp_path / "c"),
                 no_dist=True)
        loaded = {"train": {"step": 0}}
        dcp.load(loaded, storage_reader=SafeFileSystemReader(str(tmp_path / "c")), planner=SafeLoadPlanner(),
                 no_dist=True)
        assert loaded["train"]["step"] == 3                 # plain data still loads
        with pytest.raises(CheckpointException, match="train.hook is not plain data"):
            dcp.load({"train": {"hook": None}}, storage_reader=SafeFileSystemReader(str(tmp_path / "c")),
                     planner=SafeLoadPlanner(), no_dist=True)
    assert not marker.exists()


# --- durability -------------------------------------------------------------------------


def _record_fsyncs(monkeypatch, module: object, watch: Path) -> list[tuple[Path, bool]]:
    """Wrap ``module.fsync_dir`` (still fsyncing): each call's directory and whether ``watch`` existed then."""
    calls: list[tuple[Path, bool]] = []
    real = module.fsync_dir

    def fsync_dir(path: Path) -> None:
        calls.append((Path(path), watch.exists()))
        real(path)

    monkeypatch.setattr(module, "fsync_dir", fsync_dir)
    return calls


def test_delete_fsyncs_the_parent_after_its_rename(tmp_path: Path, monkeypatch) -> None:
    import raytrain_ckpt.checkpoint.storage.commit as layout_module

    layout = CheckpointLayout(tmp_path)
    _commit(layout, 1)
    calls = _record_fsyncs(monkeypatch, layout_module, layout.step_dir(1))
    layout.delete(1)
    assert (tmp_path, False) in calls          # the rename out of step-00000001 is durable


def test_export_fsyncs_its_output_and_the_parent_after_the_rename(tmp_path: Path, monkeypatch) -> None:
    import raytrain_ckpt.checkpoint.interchange.export as export_module

    step = _real_step(tmp_path / "job", 1)
    out = tmp_path / "exports" / "hf"
    calls = _record_fsyncs(monkeypatch, export_module, out)
    from raytrain_ckpt.models import describe_model
    export_checkpoint(step, out, "hf", "bf16", describe_model("debug", {"n_layers": 1}))
    assert (out.parent, True) in calls          # the final rename
    assert any(p.name.startswith("hf.tmp-") and not seen for p, seen in calls)   # the staged dir, before it
