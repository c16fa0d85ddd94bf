"""The object-store commit protocol (no rename: the manifest is written last) on fsspec's
in-memory filesystem and on a real S3 endpoint (moto's server on 127.0.0.1)."""

from __future__ import annotations

import pickle
import sys
import uuid

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint

from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.checkpoint.format.names import EntryKind
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout, LeftoverWatch
from raytrain_ckpt.checkpoint.errors import StorageUnavailable
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from raytrain_ckpt.checkpoint.storage.objects import ObjectStorage
from raytrain_ckpt.checkpoint.storage.retries import retry_transient

METADATA = pickle.dumps(Metadata(state_dict_metadata={}))
SHARD = "__0_0.distcp"


@pytest.fixture(params=["memory", "s3"])
def layout(request) -> CheckpointLayout:
    """A job root on fsspec's memory filesystem, or in a fresh bucket of the S3 endpoint."""
    if request.param == "memory":
        return CheckpointLayout(f"memory://ckpt-{uuid.uuid4().hex[:8]}/runs/job")
    endpoint = request.getfixturevalue("s3_endpoint")
    return CheckpointLayout(f"{endpoint.new_bucket()}/runs/job", options=endpoint.options)


def _write_shards(layout: CheckpointLayout, step: int, payload: bytes = b"x" * 1000) -> tuple[str, Manifest]:
    where = layout.new_tmp_dir(step)
    files = {}
    for name, data in ((SHARD, payload), (".metadata", METADATA)):
        path = layout.storage.join(where, name)
        layout.storage.write_bytes(path, data)
        files[name] = layout.describe(path)
    return where, Manifest(step=step, world_size=1, dp_size=1, spec_hash="h", files=files)


def _commit(layout: CheckpointLayout, step: int, payload: bytes = b"x" * 1000) -> str:
    where, manifest = _write_shards(layout, step, payload)
    return layout.commit(where, manifest)


def _names(layout: CheckpointLayout) -> list[str]:
    return [e.name for e, _ in layout.entries()]


def test_shards_are_written_in_place_and_the_manifest_commits(layout) -> None:
    assert not layout.atomic
    where, manifest = _write_shards(layout, 10)
    assert where == layout.step_dir(10)                     # no temporary name, no rename
    assert layout.valid_steps() == {}                       # shards without a manifest: never loaded
    with pytest.raises(InvalidCheckpoint, match="never committed"):
        layout.verify(where)
    final = layout.commit(where, manifest)
    assert final == where and layout.storage.is_file(layout.storage.join(final, MANIFEST))
    assert layout.verify(final, "checksum").step == 10
    assert list(layout.valid_steps("checksum")) == [10]


def test_a_corrupt_object_fails_its_checksum(layout) -> None:
    final = _commit(layout, 3)
    shard = layout.storage.join(final, SHARD)
    data = bytearray(layout.storage.read_bytes(shard))
    data[500] ^= 0xFF
    layout.storage.write_bytes(shard, bytes(data))
    assert layout.verify(final, "size").step == 3           # same size: only the checksum sees it
    with pytest.raises(InvalidCheckpoint, match="CRC-32C"):
        layout.verify(final, "checksum")


def test_leftovers_without_a_manifest_are_removed_on_start(layout) -> None:
    _commit(layout, 1)
    _write_shards(layout, 2)                                # a writer died before the commit
    assert sorted(layout.step_dirs()) == [1, 2] and list(layout.valid_steps()) == [1]
    assert layout.remove_leftover_tmp() == [layout.step_dir(2)]
    assert _names(layout) == ["step-00000001"]
    assert list(layout.valid_steps("checksum")) == [1]      # the committed step is untouched


def test_a_commit_never_overwrites_a_committed_step(layout) -> None:
    _commit(layout, 4)
    with pytest.raises(FileExistsError):
        layout.new_tmp_dir(4)                               # a valid step-N is never written into
    assert layout.verify(layout.step_dir(4), "checksum").step == 4


def test_a_resave_moves_a_torn_step_aside_by_copy(layout) -> None:
    final = _commit(layout, 5)
    layout.storage.remove_file(layout.storage.join(final, SHARD))   # torn: listed file missing
    _commit(layout, 5, payload=b"y" * 1000)
    names = _names(layout)
    assert "step-00000005" in names and any(n.startswith("step-00000005.invalid-") for n in names)
    assert layout.verify(layout.step_dir(5), "checksum").step == 5
    aside = next(p for e, p in layout.entries() if e.kind is EntryKind.INVALID)
    assert layout.read_manifest(aside).step == 5            # kept with its manifest, never loaded
    assert list(layout.valid_steps()) == [5]


def test_retention_deletes_the_manifest_first(layout, monkeypatch) -> None:
    _commit(layout, 1)
    _commit(layout, 2)
    storage = layout.storage

    def crash(path) -> None:
        raise OSError("killed mid-delete")

    monkeypatch.setattr(storage, "remove_tree", crash)
    with pytest.raises(OSError):
        layout.delete(1)
    monkeypatch.undo()
    # the crash left shards without a manifest: not a step that looks committed, and cleaned on start
    assert storage.is_dir(layout.step_dir(1)) and list(layout.valid_steps()) == [2]
    assert layout.remove_leftover_tmp() == [layout.step_dir(1)]
    layout.delete(2)
    assert _names(layout) == []


def test_abandon_keeps_the_step_under_its_new_name(layout) -> None:
    _commit(layout, 1)
    _commit(layout, 2)
    aside = layout.abandon(2, "ab12")
    assert _names(layout) == ["step-00000001", "step-00000002.abandoned-ab12"]
    assert list(layout.valid_steps()) == [1]                # never loaded
    m = layout.read_manifest(aside)
    assert m.step == 2 and all(layout.storage.size(layout.storage.join(aside, n)) == f.size
                               for n, f in m.files.items())


def test_a_move_interrupted_after_the_copy_loses_nothing(layout, monkeypatch) -> None:
    _commit(layout, 7)
    storage = layout.storage
    monkeypatch.setattr(storage, "remove_file", lambda path: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError):
        layout.abandon(7, "cd34")
    monkeypatch.undo()
    # the copy is complete and step-7 is still committed: a retry moves it, nothing was lost
    assert layout.verify(layout.step_dir(7), "checksum").step == 7
    assert "step-00000007.abandoned-cd34" in _names(layout)


def test_a_missing_filesystem_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "gcsfs", None)        # as if gcsfs were not installed
    with pytest.raises(StorageUnavailable, match=r"pip install 'raytrain-ckpt\[gcs\]'"):
        open_storage("gs://bucket/ckpt")
    with pytest.raises(StorageUnavailable, match="unknown storage scheme"):
        open_storage("nosuch://bucket/ckpt")


def test_transient_s3_errors_are_retried(s3_endpoint, flaky_s3) -> None:
    bucket = s3_endpoint.new_bucket()
    storage = ObjectStorage(bucket, {**s3_endpoint.options, "endpoint_url": flaky_s3.url,
                                     "config_kwargs": {"retries": {"max_attempts": 1}}})
    storage.fs.retries = 1                                  # s3fs's own retry loop: one try
    flaky_s3.fail(4)                                        # 503 SlowDown, reset, 503, reset
    retried: list[BaseException] = []
    retry_transient(lambda: storage.fs.pipe_file(f"{bucket}/a", b"data"), "put", retried.append, backoff_s=0.01)
    # every failure was answered by a retry: ours (counted), or the HTTP client's own (a reconnect)
    assert flaky_s3.failed == 4 and 1 <= len(retried) <= 4
    assert storage.read_bytes(f"{bucket}/a") == b"data"


def test_a_permanent_error_is_not_retried(s3_endpoint) -> None:
    storage = ObjectStorage("s3://no-such-bucket", s3_endpoint.options)
    calls = []

    def put() -> None:
        calls.append(1)
        storage.fs.pipe_file("s3://no-such-bucket/a", b"x")

    with pytest.raises(FileNotFoundError):
        retry_transient(put, "put", backoff_s=0.01)
    assert len(calls) == 1


def test_import_to_s3_commits_step_0_that_verifies_and_exports_back(s3_endpoint, tmp_path, capsys) -> None:
    import torch

    from raytrain_ckpt.cli.main import main

    weights = {"tok_embeddings.weight": torch.randn(16, 8), "norm.weight": torch.rand(8)}
    torch.save(weights, tmp_path / "m.pt")
    root = f"{s3_endpoint.new_bucket()}/imported"
    assert main(["import", str(tmp_path / "m.pt"), "--to", root]) == 0
    step = f"{root}/step-00000000"
    assert step in capsys.readouterr().out
    layout = CheckpointLayout(root, options=s3_endpoint.options)
    assert _names(layout) == ["step-00000000"] and layout.verify(step, "checksum").step == 0
    assert main(["verify", step]) == 0 and "VALID" in capsys.readouterr().out
    assert main(["export", step, "--format", "torch", "--dtype", "fp32", "--out", str(tmp_path / "back")]) == 0
    back = torch.load(tmp_path / "back" / "model.pt", weights_only=True)
    assert set(back) == set(weights) and all(torch.equal(back[k], v) for k, v in weights.items())
    # a second import never overwrites the committed step
    assert main(["import", str(tmp_path / "m.pt"), "--to", root]) == 2
    assert "already holds step-00000000" in capsys.readouterr().err
    # an import stopped before its manifest (killed mid-upload) left a leftover, not a checkpoint:
    # importing again replaces it (it said 'already holds step-00000000; a checkpoint is never overwritten')
    torn = f"{s3_endpoint.new_bucket()}/imported"
    layout = CheckpointLayout(torn, options=s3_endpoint.options)
    layout.storage.write_bytes(layout.storage.join(layout.step_dir(0), "__0_0.distcp"), b"partial")
    assert main(["import", str(tmp_path / "m.pt"), "--to", torn]) == 0, capsys.readouterr().err
    assert layout.verify(layout.step_dir(0), "checksum").step == 0


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seen, grace_s, stale", [
    # (snapshot at t=0, t=10, t=20) per entry; grace 15s
    ({"a": ("x", "x", "x")}, 15.0, ["a"]),            # unchanged from its first sight: stale at t=20
    ({"a": ("x", "y", "y")}, 15.0, []),               # changed at t=10: its grace restarts
    ({"a": (None, "x", "x")}, 15.0, []),              # first seen at t=10: only 10s
    ({"a": ("x", "x", "x"), "b": ("x", "y", "z")}, 15.0, ["a"]),
    ({"a": ("x", "x", "x")}, 30.0, []),
])
def test_leftover_watch_judges_by_its_own_clock(seen, grace_s, stale) -> None:
    clock = _Clock()
    watch = LeftoverWatch(grace_s, clock)
    out: list[str] = []
    for t in range(3):
        clock.now = 1000.0 + 10 * t
        out = watch.stale({name: snaps[t] for name, snaps in seen.items() if snaps[t] is not None})
    assert out == stale


def test_stale_leftovers_are_removed_after_the_grace_period_never_in_flight(layout) -> None:
    clock = _Clock()
    watch = LeftoverWatch(60.0, clock)
    _commit(layout, 1)
    _write_shards(layout, 2)                                # an aborted save a slow writer uploaded into
    _write_shards(layout, 3)                                # in flight in this job
    in_flight = [layout.step_dir(3)]
    assert layout.remove_stale_leftovers(watch, in_flight) == []        # first sight
    clock.now += 59
    assert layout.remove_stale_leftovers(watch, in_flight) == []        # within the grace period
    # a late upload into step 2 restarts its grace period
    layout.storage.write_bytes(layout.storage.join(layout.step_dir(2), "__1_0.distcp"), b"late")
    clock.now += 2
    assert layout.remove_stale_leftovers(watch, in_flight) == []
    clock.now += 60
    assert layout.remove_stale_leftovers(watch, in_flight) == [layout.step_dir(2)]
    assert _names(layout) == ["step-00000001", "step-00000003"]  # the step in flight is never touched
    assert list(layout.valid_steps("checksum")) == [1]      # nor the committed one
    assert layout.storage.snapshot(layout.step_dir(2)) == frozenset()


def _s3_actor(s3_endpoint, steps: list[int]):
    from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
    from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy

    root = f"{s3_endpoint.new_bucket()}/runs/job"
    layout = CheckpointLayout(root, options=s3_endpoint.options)
    for step in steps:
        _commit(layout, step)
    return CheckpointActor(root, RetentionPolicy(1), s3_endpoint.options), layout


def test_an_export_lease_on_s3_keeps_its_step_from_retention(s3_endpoint) -> None:
    from raytrain_ckpt.checkpoint.storage.leases import LEASE_DIR, FileLease

    actor, layout = _s3_actor(s3_endpoint, [1, 2])
    with FileLease(layout.root, 1) as lease:
        assert lease.path == f"{layout.root}/{LEASE_DIR}/{layout.storage.name(lease.path)}"
        assert layout.storage.is_file(lease.path)           # an object beside the steps
        actor._purge()
        assert sorted(actor.committed) == [1, 2] and layout.verify(layout.step_dir(1), "checksum").step == 1
    assert not layout.storage.is_file(lease.path)
    actor._purge()                                          # released: retention keeps only the newest
    assert sorted(actor.committed) == [2] and sorted(layout.step_dirs()) == [2]


def test_a_lease_taken_while_retention_deletes_on_s3_puts_the_manifest_back(s3_endpoint, monkeypatch) -> None:
    from raytrain_ckpt.checkpoint.storage.leases import FileLease

    actor, layout = _s3_actor(s3_endpoint, [1, 2])
    # the exporter's PUT lands just after the actor read the leases: retention decides to delete
    # step 1, removes its manifest, and its second read of the leases finds the new one
    reads = iter([set()])
    real = actor.lease_files.leased_steps
    monkeypatch.setattr(actor.lease_files, "leased_steps", lambda: next(reads, None) or real())
    with FileLease(layout.root, 1):
        actor._purge()
        assert sorted(actor.committed) == [1, 2] and actor.purge_errors == 0
        assert layout.verify(layout.step_dir(1), "checksum").step == 1  # the same manifest, objects untouched
    actor._purge()
    assert sorted(layout.step_dirs()) == [2]


def test_an_exporter_that_finds_the_manifest_gone_on_s3_says_so(s3_endpoint) -> None:
    from raytrain_ckpt.checkpoint.storage.leases import LEASE_DIR, FileLease

    _, layout = _s3_actor(s3_endpoint, [1, 2])
    layout.delete(1)                                        # retention got there first
    with pytest.raises(InvalidCheckpoint, match="removed .* before it could be leased"):
        FileLease(layout.root, 1).__enter__()
    assert layout.storage.listdir(layout.storage.join(layout.root, LEASE_DIR)) == []   # no lease left behind


def test_a_stale_lease_object_stops_pinning_after_ttl_of_the_readers_clock(s3_endpoint) -> None:
    import time

    from raytrain_ckpt.checkpoint.storage.leases import FileLease, LeaseFiles

    _, layout = _s3_actor(s3_endpoint, [1])
    clock = _Clock()
    reader = LeaseFiles(layout.root, ttl_s=60.0, clock=clock, storage=layout.storage)
    with FileLease(layout.root, 1, heartbeat_s=0.05) as lease:
        deadline = time.monotonic() + 30
        while lease.beats < 2 and time.monotonic() < deadline:    # real beats: PUTs of the object
            time.sleep(0.05)
        assert lease.beats >= 2 and reader.leased_steps() == {1}
        lease._stop.set()                                   # the holder stops beating (a killed exporter)
        assert lease._thread is not None
        lease._thread.join()
        assert reader.leased_steps() == {1}                 # the last beat, as this reader saw it
        clock.now += 59
        assert reader.leased_steps() == {1}
        clock.now += 2
        assert reader.leased_steps() == set() and not layout.storage.is_file(lease.path)


def test_an_export_whose_step_is_deleted_meanwhile_writes_nothing(s3_endpoint, tmp_path, monkeypatch) -> None:
    import torch

    from raytrain_ckpt.checkpoint.interchange import export
    from raytrain_ckpt.checkpoint.errors import ConversionError
    from raytrain_ckpt.checkpoint.interchange.importer import import_checkpoint

    torch.save({"norm.weight": torch.rand(8)}, tmp_path / "m.pt")
    step = import_checkpoint(tmp_path / "m.pt", f"{s3_endpoint.new_bucket()}/runs").path
    layout = CheckpointLayout(str(step).rsplit("/", 1)[0], options=s3_endpoint.options)
    write = export._write_torch

    def write_then_lose_the_step(*args):                    # a delete the lease did not stop (judged stale)
        out = write(*args)
        layout.storage.remove_file(layout.storage.join(step, MANIFEST))
        return out

    monkeypatch.setattr(export, "_write_torch", write_then_lose_the_step)
    with pytest.raises(ConversionError, match="changed while it was being exported .* nothing was written"):
        export.export_checkpoint(step, tmp_path / "out", "torch", "fp32")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_an_exporter_that_cannot_put_a_lease_exports_without_one(s3_endpoint, tmp_path, monkeypatch, caplog) -> None:
    import torch

    from raytrain_ckpt.checkpoint.interchange.export import export_checkpoint
    from raytrain_ckpt.checkpoint.interchange.importer import import_checkpoint

    weights = {"norm.weight": torch.rand(8)}
    torch.save(weights, tmp_path / "m.pt")
    step = import_checkpoint(tmp_path / "m.pt", f"{s3_endpoint.new_bucket()}/runs").path
    put = ObjectStorage.write_bytes

    def read_only_leases(self, path, data) -> None:      # credentials that may read the bucket, not write it
        if "/leases/" in str(path):
            raise PermissionError(f"AccessDenied: PUT {path}")
        put(self, path, data)

    monkeypatch.setattr(ObjectStorage, "write_bytes", read_only_leases)
    export_checkpoint(step, tmp_path / "out", "torch", "fp32")
    assert "exporting without one" in caplog.text
    back = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert torch.equal(back["norm.weight"], weights["norm.weight"])


@pytest.mark.parametrize("error", [OSError(13, "AccessDenied on this request"), OSError(5, "InternalError")])
def test_a_failed_lookup_of_a_manifest_never_deletes_its_committed_step(error, monkeypatch) -> None:
    """A start removes ``step-N/`` prefixes without a manifest (saves that never committed). A
    request for a committed step's manifest that fails (a 500 past its retries, a denied HEAD) is
    no answer: the step is kept, and found committed once the store answers again."""
    from fsspec.implementations.memory import MemoryFileSystem

    from raytrain_ckpt.checkpoint.storage import retries

    layout = CheckpointLayout(f"memory://ckpt-{uuid.uuid4().hex[:8]}/runs/job")
    _commit(layout, 1)
    _commit(layout, 2)
    _write_shards(layout, 3)                                 # a save that never committed
    real = MemoryFileSystem.info

    def failing(self, path, **kw):
        if str(path).endswith(f"step-00000001/{MANIFEST}"):
            raise error
        return real(self, path, **kw)

    monkeypatch.setattr(MemoryFileSystem, "info", failing)
    monkeypatch.setattr(retries, "BACKOFF_S", 0.001)
    monkeypatch.setattr(retry_transient, "__defaults__", (None, retries.RETRIES, 0.001, retries.is_transient))
    removed = layout.remove_leftover_tmp()
    monkeypatch.undo()
    assert [layout.storage.name(p) for p in removed] == ["step-00000003"]
    assert sorted(layout.valid_steps("checksum")) == [1, 2]


def test_a_lease_object_replaced_while_it_is_read_is_read_whole_old_or_new(s3_endpoint) -> None:
    """A reader on another host holds no lock against the heartbeat's PUTs: one read of a lease
    object racing its replacement must still see the old or the new object, never nothing (an
    unread lease protects no step)."""
    import threading

    from raytrain_ckpt.checkpoint.storage.leases import LEASE_DIR, LEASE_MAX_BYTES, _read_leases
    from raytrain_ckpt.checkpoint.storage.posix import read_small_file

    _, layout = _s3_actor(s3_endpoint, [1])
    storage = layout.storage
    d = storage.join(layout.root, LEASE_DIR)
    path = storage.join(d, "export-0000abcd.json")
    put = layout.protocol.replace_small_file
    put(path, b'{"step": 1, "beat": 0}')
    stop, beats = threading.Event(), [0]

    def beat() -> None:                                     # a heartbeat as fast as the store takes it
        while not stop.is_set():
            beats[0] += 1
            put(path, ('{"step": 1, "beat": %d%s}' % (beats[0], " " * (beats[0] % 7))).encode())

    writer = threading.Thread(target=beat, daemon=True)
    writer.start()
    try:
        missed = 0
        for _ in range(150):
            missed += _read_leases(storage, d).get("export-0000abcd.json", (None,))[0] != 1
            read_small_file(storage, path, LEASE_MAX_BYTES)  # raises where a read saw two objects
    finally:
        stop.set()
        writer.join()
    assert beats[0] > 20 and missed == 0


def test_a_small_object_read_is_bounded_and_an_empty_one_reads_empty(s3_endpoint) -> None:
    from raytrain_ckpt.checkpoint.storage.posix import read_small_file

    _, layout = _s3_actor(s3_endpoint, [1])
    storage = layout.storage
    path = storage.join(layout.root, ".group.json")
    layout.protocol.replace_small_file(path, b"")
    assert read_small_file(storage, path, 16) == b""
    layout.protocol.replace_small_file(path, b"x" * 17)
    with pytest.raises(ValueError, match="over the 16 bytes"):
        read_small_file(storage, path, 16)
    layout.protocol.replace_small_file(path, b"x" * 16)
    assert read_small_file(storage, path, 16) == b"x" * 16
    with pytest.raises(FileNotFoundError):
        read_small_file(storage, storage.join(layout.root, "absent.json"), 16)
