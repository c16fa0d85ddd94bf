"""Untrusted bytes are decoded under the kernel's limits, and tensor chunks without an unpickler.

Each attack below passes the opcode pre-scan (``prescan.py``): only the reader process's
``RLIMIT_AS``/``RLIMIT_CPU`` (``sandbox.py``) or the tensor chunk whitelist (``tensorblob.py``)
stops it. The limits are lowered here (``RAYTRAIN_CKPT_READ_LIMITS``) so each case costs a
moment; the files and the code paths are the real ones.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, UnsafeCheckpoint
from raytrain_ckpt.checkpoint.format import scancache
from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest, describe_file
from raytrain_ckpt.checkpoint.format.metadata import load_metadata
from raytrain_ckpt.checkpoint.format.prescan import check_pickle, check_torch_save
from raytrain_ckpt.checkpoint.format.sandbox import LIMITS_ENV
from raytrain_ckpt.checkpoint.format.tensorblob import load_chunk, parse_tensor_pickle
from raytrain_ckpt.checkpoint.format.unpickling import check_metadata_stream
from tests.unit.test_bounded_reads import _bounded, _dcp_step, _replace_metadata, _shared_nest

MEMO_BOMB = b"\x80\x02N" + b"r" + struct.pack("<I", 20_000_000) + b"."
"""9 bytes: ``None`` put in the memo at index 2e7; CPython's unpickler sizes a memo array of
twice that (320 MB) to hold it."""


def _colliding_dict(n: int) -> bytes:
    """A pickled dict whose ``n`` int keys all hash to 0 on CPython (multiples of 2**61 - 1),
    written opcode by opcode: building the dict here would cost this process the quadratic
    hashing the file is made to cost its reader (6 s for 30,000 keys)."""
    keys = b"".join(pickle.dumps(k * (2**61 - 1), protocol=2)[2:-1] + b"K\x00" for k in range(1, n + 1))
    return b"\x80\x02}(" + keys + b"u."


def test_the_colliding_dict_is_the_dict_it_describes():
    assert pickle.loads(_colliding_dict(300)) == {k * (2**61 - 1): 0 for k in range(1, 301)}
    assert all(hash(k) == 0 for k in pickle.loads(_colliding_dict(300)))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(scancache, "_SEEN", set())
    monkeypatch.setenv(scancache.CACHE_ENV, "0")
    monkeypatch.setenv(LIMITS_ENV, "0.2")  # 100 MiB + 10 bytes a byte, 1 s CPU + 0.6 s a MB


def test_the_memo_bomb_is_9_bytes_and_passes_the_prescan():
    assert len(MEMO_BOMB) == 9
    check_pickle(MEMO_BOMB, "m")  # the opcode model sees one small object


def test_the_memo_bomb_is_refused_at_the_memory_limit_naming_the_file():
    for read in (lambda: check_metadata_stream(io.BytesIO(MEMO_BOMB), "job/step-3/.metadata"),
                 lambda: load_metadata(io.BytesIO(MEMO_BOMB), "job/step-3/.metadata")):
        with pytest.raises(InvalidCheckpoint, match=r"job/step-3/\.metadata: decoding it needed over \d+ MiB"):
            read()


def test_a_dict_of_colliding_keys_is_refused_at_the_time_limit():
    data = _colliding_dict(30_000)
    check_pickle(data, "m")  # every budget of the pre-scan passes
    with pytest.raises(InvalidCheckpoint, match="time limit"):
        check_metadata_stream(io.BytesIO(data), "job/step-3/.metadata")


def _torch_save_with_pickle(pkl: bytes) -> bytes:
    buf = io.BytesIO()
    torch.save({}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, pkl if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


def test_an_optimizer_entry_of_colliding_keys_is_refused_before_torch_reads_it():
    blob = _torch_save_with_pickle(_colliding_dict(30_000))
    with pytest.raises(InvalidCheckpoint, match="time limit"):
        check_torch_save(io.BytesIO(blob), "entry optim.state")


def test_a_tensor_chunk_is_parsed_by_a_whitelist_not_unpickled():
    for tensor in (torch.arange(6.0).reshape(2, 3), torch.ones(3, 4).t(), torch.zeros((), dtype=torch.bfloat16),
                   torch.arange(4.0).to(torch.float8_e4m3fn)):
        buf = io.BytesIO()
        torch.save(tensor, buf)
        buf.seek(0)
        got = load_chunk(buf, "c")
        assert got.dtype == tensor.dtype and got.stride() == tensor.stride()
        assert torch.equal(got.float(), tensor.float())
    for pkl in (b"\x80\x02}" + _shared_nest() + b"K\x01s.", MEMO_BOMB, _colliding_dict(10)):
        with pytest.raises(InvalidCheckpoint, match="not a tensor chunk"):
            parse_tensor_pickle(pkl, "c")


def test_a_tensor_reaching_past_its_storage_is_refused():
    buf = io.BytesIO()
    torch.save(torch.arange(4.0), buf)
    data = buf.getvalue().replace(b"K\x04\x85", b"K\xff\x85", 1)  # size (255,) over 4 elements
    with pytest.raises(InvalidCheckpoint, match="reaches past"):
        load_chunk(io.BytesIO(data), "c")


def _bomb_a_tensor_chunk(step: Path) -> None:
    """Append a hash-bomb ``torch.save`` blob to a shard, point one tensor chunk at it, and
    recompute the metadata and the manifest's sizes and checksums (every file checks out)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = pickle.loads((step / ".metadata").read_bytes())  # this test's own file
    index = next(k for k in metadata.storage_data
                 if isinstance(metadata.state_dict_metadata[k.fqn], TensorStorageMetadata))
    shard = step / metadata.storage_data[index].relative_path
    blob = _torch_save_with_pickle(b"\x80\x02}" + _shared_nest() + b"K\x01s.")
    assert len(blob) < 4096
    start = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = _StorageInfo(shard.name, start, len(blob))
    _replace_metadata(step, pickle.dumps(metadata))
    fields = Manifest.from_json((step / MANIFEST).read_text()).model_dump(mode="json", exclude_none=True)
    fields["files"][shard.name] = describe_file(shard)
    (step / MANIFEST).write_text(Manifest.model_validate(fields).to_json())


@pytest.mark.parametrize("command", ["verify", "export"])
def test_a_hash_bomb_in_place_of_a_tensor_chunk_is_refused(tmp_path, command):
    step = _dcp_step(tmp_path / "job")
    _bomb_a_tensor_chunk(step)
    args = {"verify": ["verify", str(step)],
            "export": ["export", str(step), "--format", "torch", "--out", str(tmp_path / "out")]}[command]
    out = _bounded(*args)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "not a tensor chunk" in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists()


def test_a_real_step_still_loads_through_the_whitelist(tmp_path):
    step = _dcp_step(tmp_path / "job")
    out = _bounded("export", str(step), "--format", "torch", "--out", str(tmp_path / "out.pt"))
    assert out.returncode == 0, out.stderr
    exported = torch.load(tmp_path / "out.pt", weights_only=True)
    assert any(isinstance(v, torch.Tensor) for v in exported.values())


class _Key:
    def __init__(self, offset: tuple[int, ...]) -> None:
        self.fqn, self.offset = "w", offset


def _row_split(n: int, overlap_at: int | None = None):
    """Metadata of a float32 ``[1, n]`` tensor saved in ``n`` chunks along its second dimension
    (each its own 4 bytes of one file); ``overlap_at``: that chunk moved one element left."""
    from types import SimpleNamespace as NS

    cols = [i - 1 if i == overlap_at else i for i in range(n)]
    chunks = [NS(offsets=(0, c), sizes=(1, 1)) for c in cols]
    storage = {_Key((0, c)): NS(relative_path="f", offset=4 * i, length=4) for i, c in enumerate(cols)}
    md = NS(size=(1, n), chunks=chunks, properties=NS(dtype=NS(itemsize=4)))
    return NS(state_dict_metadata={"w": md}, storage_data=storage)


def test_the_chunk_overlap_check_is_not_quadratic_in_a_second_dimension_split():
    from raytrain_ckpt.checkpoint.format.chunks import layout_problem

    n = 100_000  # quadratic: 5e9 box pairs; linear: a fraction of a second
    assert layout_problem(_row_split(n), {"f": 4 * n}) is None
    assert "that overlap" in layout_problem(_row_split(n, overlap_at=n // 2), {"f": 4 * n})


def test_overlapping_chunks_of_equal_volume_are_named_in_any_dimension():
    from raytrain_ckpt.checkpoint.format.chunks import _overlap

    grid = [((r, c), (1, 2)) for r in range(3) for c in (0, 2)]
    assert _overlap(grid) is None
    assert _overlap(grid + [((1, 1), (1, 2))]) == ((1, 0), (1, 1))
    staggered = [((0, 0), (1, 3)), ((0, 3), (1, 1)), ((1, 0), (1, 1)), ((1, 1), (1, 3)), ((1, 2), (1, 1))]
    assert _overlap(staggered) == ((1, 1), (1, 2))


def _plant_verdict(cache: Path, key: str, how: str) -> None:
    """A verdict for ``key`` in a log under ``cache/raytrain_ckpt/scanned`` that is not this user's own."""
    import os

    base = cache / "raytrain_ckpt" / "scanned"
    if how == "symlinked":
        elsewhere = cache / "planted"
        elsewhere.mkdir(parents=True)
        (elsewhere / scancache.LOG).write_text(f"{key}\n")
        base.parent.mkdir(parents=True)
        base.symlink_to(elsewhere)
        return
    base.mkdir(parents=True)
    os.chmod(cache / "raytrain_ckpt", 0o700)
    os.chmod(base, 0o700)
    (base / scancache.LOG).write_text(f"{key}\n")
    os.chmod(base / scancache.LOG, 0o600)
    if how == "world-writable":
        os.chmod(base, 0o777)
    elif how == "foreign-owned":
        os.chown(base / scancache.LOG, 12345, 12345)
    elif how == "group-writable-log":
        os.chmod(base / scancache.LOG, 0o620)
    elif how == "linked-verdict":
        (cache / "anything").write_text(f"{key}\n")
        (base / scancache.LOG).unlink()
        (base / scancache.LOG).symlink_to(cache / "anything")


@pytest.mark.parametrize("how", ["world-writable", "symlinked", "foreign-owned", "group-writable-log", "linked-verdict"])
def test_a_verdict_that_is_not_ours_is_ignored(tmp_path, monkeypatch, how):
    import os

    if how == "foreign-owned" and os.getuid() != 0:
        pytest.skip("chown to another uid needs root")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(scancache.CACHE_ENV)
    nest = b"\x80\x02" + _shared_nest(40) + b"."
    from raytrain_ckpt.checkpoint.format.prescan import DEFAULT_BUDGET

    _plant_verdict(tmp_path / "cache", scancache.digest(nest, repr(DEFAULT_BUDGET.scaled())), how)
    with pytest.raises(InvalidCheckpoint, match="shared references"):
        check_pickle(nest, "x")


def test_a_verdict_of_ours_is_taken(tmp_path, monkeypatch):
    """The control of the test above: the same planted verdict, in a log that is this user's own,
    spares the scan (so each refusal above is the ownership check's)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(scancache.CACHE_ENV)
    scancache.forget()
    nest = b"\x80\x02" + _shared_nest(40) + b"."
    from raytrain_ckpt.checkpoint.format.prescan import DEFAULT_BUDGET

    _plant_verdict(tmp_path / "cache", scancache.digest(nest, repr(DEFAULT_BUDGET.scaled())), "ours")
    check_pickle(nest, "x")


def test_the_verdict_log_is_read_from_where_this_process_stopped(tmp_path, monkeypatch):
    """Verdicts other commands append are found on this process's next miss; a line still being
    written, or one that is not a key, is not taken; a new log in the old one's place is read
    from its start."""
    import hashlib
    import os

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(scancache.CACHE_ENV)
    scancache.forget()
    keys = [hashlib.sha256(bytes([i])).hexdigest() for i in range(6)]
    scancache.remember_passes(keys[:2])
    log = tmp_path / "cache" / "raytrain_ckpt" / "scanned" / scancache.LOG
    assert log.read_text() == f"{keys[0]}\n{keys[1]}\n"
    scancache.forget()                                     # a later command: only the log remembers
    assert scancache.passed_before(keys[0]) and scancache.passed_before(keys[1])
    assert not scancache.passed_before(keys[2])
    with open(log, "a") as f:                              # another command appends, one line torn
        f.write(f"{keys[2]}\nnot-a-key\n{keys[3][:30]}")
    assert scancache.passed_before(keys[2])
    assert not scancache.passed_before(keys[3])
    with open(log, "a") as f:
        f.write(f"{keys[3][30:]}\n")
    assert scancache.passed_before(keys[3])
    assert not scancache.passed_before("not-a-key")
    monkeypatch.setattr(scancache, "LOG_MAX_BYTES", log.stat().st_size)
    scancache.remember_pass(keys[4])                       # full: a new log begins with it
    assert log.read_text() == f"{keys[4]}\n"
    scancache.forget()
    assert scancache.passed_before(keys[4]) and not scancache.passed_before(keys[0])
    fresh = log.with_name("another-command.new")           # a new log put in place by another command,
    fresh.write_text(f"{keys[5]}\n")                      # as long as the one this process read
    os.chmod(fresh, 0o600)
    os.replace(fresh, log)
    assert scancache.passed_before(keys[5])


def test_a_full_verdict_log_is_read_whole_by_a_later_command(tmp_path, monkeypatch):
    """A log near its size limit holds more verdicts than a process used to keep: a later command
    read part of it, forgot it half way and never read that part again (every such file was
    scanned again); now it finds every one, and a process that holds its own keys reads the log
    again from its start rather than drop what it read."""
    import hashlib

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(scancache.CACHE_ENV)
    scancache.forget()
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(scancache.LOG_MAX_BYTES // 65)]
    scancache.remember_passes(keys)
    scancache.forget()                                     # a later command
    assert all(scancache.passed_before(k) for k in keys[:1000] + keys[-1000:])
    monkeypatch.setattr(scancache, "_SEEN_MAX", len(keys) + 10)
    scancache.forget()
    assert scancache.passed_before(keys[0])                # the whole log read
    mine = [hashlib.sha256(f"own {i}".encode()).hexdigest() for i in range(20)]
    scancache._SEEN.update(mine)                          # this process's own verdicts fill it up
    with open(tmp_path / "cache" / "raytrain_ckpt" / "scanned" / scancache.LOG, "a") as f:
        f.write(f"{hashlib.sha256(b'appended').hexdigest()}\n")
    assert scancache.passed_before(hashlib.sha256(b"appended").hexdigest())
    assert all(scancache.passed_before(k) for k in keys[:1000])


def test_the_cache_folders_are_made_private_and_a_pass_is_remembered(tmp_path, monkeypatch):
    import os
    import stat

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(scancache.CACHE_ENV)
    os.umask(0o022)
    check_pickle(pickle.dumps({"a": 1}), "x")
    made = [tmp_path / "cache", tmp_path / "cache" / "raytrain_ckpt", tmp_path / "cache" / "raytrain_ckpt" / "scanned"]
    assert [stat.S_IMODE(p.stat().st_mode) for p in made] == [0o700] * len(made)
    assert [(p.name, stat.S_IMODE(p.stat().st_mode)) for p in made[-1].iterdir()] == [(scancache.LOG, 0o600)]
    monkeypatch.setattr(scancache, "_SEEN", set())
    assert scancache.passed_before(scancache.digest(pickle.dumps({"a": 1}), repr(
        __import__("raytrain_ckpt.checkpoint.format.prescan", fromlist=["x"]).DEFAULT_BUDGET.scaled())))


def _same_as_one_by_one(layout, paths, together) -> None:
    """Each verdict of ``verify_many`` is the one ``verify`` gives that step alone, remembering nothing."""
    scancache.forget()
    for path, verdict in zip(paths, together):
        try:
            alone: object = layout.verify(path, "size")
        except InvalidCheckpoint as exc:
            alone = exc
        assert type(alone) is type(verdict) and str(alone) == str(verdict)


def test_steps_checked_together_get_the_verdicts_each_gets_alone(tmp_path):
    """``ls`` / ``status`` / the registry send many ``.metadata`` checks to the reader process at
    once (``verify_steps``): a file over the memory limit and one over the time limit, among intact
    steps, are each refused naming their limit (the reader process they end is replaced for the
    rest), a file that asks for code is refused, and every other step is valid, as one by one."""
    from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

    root = tmp_path / "job"
    hostile = {3: MEMO_BOMB, 5: _colliding_dict(30_000), 6: b"\x80\x04cposix\nsystem\n."}
    for step in range(1, 9):
        path = _dcp_step(root, step)
        if step in hostile:
            _replace_metadata(path, hostile[step])
    layout = CheckpointLayout(root)
    paths = [layout.step_dir(s) for s in range(1, 9)]
    together = layout.verify_many(paths, "size")
    needles = {3: "decoding it needed over", 5: "time limit", 6: "posix.system"}
    for step, verdict in zip(range(1, 9), together):
        if step in hostile:
            assert isinstance(verdict, InvalidCheckpoint) and needles[step] in str(verdict), verdict
            assert f"step-0000000{step}: .metadata" in str(verdict), verdict
        else:
            assert isinstance(verdict, Manifest) and verdict.step == step
    _same_as_one_by_one(layout, paths, together)
    checked = layout.verify_many(paths, "checksum")  # with every chunk's header parsed too
    assert [isinstance(v, Manifest) for v in checked] == [s not in hostile for s in range(1, 9)]


def test_a_long_root_is_checked_on_two_reader_processes_with_the_verdicts_each_gets_alone(tmp_path, monkeypatch):
    """``ls`` of a root of more steps than one group keeps two groups in flight, each on a reader
    process of its own: hostile files in either (one ending its reader while the other reader
    works) are refused naming their limit, every other step is valid, as one by one."""
    from raytrain_ckpt.checkpoint.format import sandbox
    from raytrain_ckpt.checkpoint.format.verify import _GROUP_FILES
    from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    n = 2 * _GROUP_FILES + 16
    hostile = {3: MEMO_BOMB, _GROUP_FILES + 8: _colliding_dict(30_000), _GROUP_FILES + 9: b"\x80\x04cposix\nsystem\n.",
               2 * _GROUP_FILES + 6: MEMO_BOMB + b"\n"}
    root = tmp_path / "job"
    for step in range(1, n + 1):
        path = _dcp_step(root, step)
        if step in hostile:
            _replace_metadata(path, hostile[step])
    used: list[str] = []
    for name in ("_READER", "_SECOND"):
        reader = getattr(sandbox, name)
        monkeypatch.setattr(reader, "submit", lambda *a, _r=reader.submit, _n=name: used.append(_n) or _r(*a))
    layout = CheckpointLayout(root)
    paths = [layout.step_dir(s) for s in range(1, n + 1)]
    together = layout.verify_many(paths, "size")
    assert used == ["_READER", "_SECOND", "_READER"], used
    needles = {3: "decoding it needed over", _GROUP_FILES + 8: "time limit", _GROUP_FILES + 9: "posix.system",
               2 * _GROUP_FILES + 6: "decoding it needed over"}
    for step, verdict in zip(range(1, n + 1), together):
        if step in hostile:
            assert isinstance(verdict, InvalidCheckpoint) and needles[step] in str(verdict), (step, verdict)
        else:
            assert isinstance(verdict, Manifest) and verdict.step == step, (step, str(verdict))
    _same_as_one_by_one(layout, paths, together)


def test_a_batch_whose_reader_exited_before_it_was_read_keeps_the_answers_in_its_pipe(tmp_path):
    """A batch the reader answered in full while the caller was busy, its last decode over the
    memory limit (the reader exits after saying so): the answers before it are read from the
    exited process's pipe, not taken for a time limit of a fresh process that never got them."""
    import time

    from raytrain_ckpt.checkpoint.format import sandbox

    good = (_dcp_step(tmp_path / "job") / ".metadata").read_bytes()
    jobs = [(good + bytes(i), f"m{i}", {"decode_only": True}) for i in range(3)] + [(MEMO_BOMB, "bomb", {})]
    batch = sandbox.submit_decodes("metadata", jobs)
    proc = batch.reader._proc
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is not None                         # it answered all four and exited
    answers = sandbox.collect_decodes(batch)
    assert answers[:3] == [None, None, None], answers
    assert isinstance(answers[3], InvalidCheckpoint) and "needed over" in str(answers[3]), answers[3]


def _exited(proc) -> None:
    import time

    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is not None


def test_starting_the_reader_under_an_unread_batch_keeps_its_answers(tmp_path):
    """``start_reader`` (``ls``, ``verify``, another thread's command) while a batch's reader has
    answered and exited: the batch's answers are still read from its pipe, none lost."""
    from raytrain_ckpt.checkpoint.format import sandbox

    good = (_dcp_step(tmp_path / "job") / ".metadata").read_bytes()
    jobs = [(good + bytes(i), f"m{i}", {"decode_only": True}) for i in range(3)] + [(MEMO_BOMB, "bomb", {})]
    batch = sandbox.submit_decodes("metadata", jobs)
    _exited(batch.reader._proc)
    sandbox.start_reader()
    answers = sandbox.collect_decodes(batch)
    assert answers[:3] == [None, None, None], answers
    assert isinstance(answers[3], InvalidCheckpoint) and "needed over" in str(answers[3]), answers[3]


def test_files_a_failed_reader_never_answered_are_refused_not_passed(tmp_path, monkeypatch):
    """The system refuses a new reader process (``EAGAIN``) while a group is being read, after a
    bomb ended the first: the files after it were never checked, so each is refused, naming why
    (a missing answer once read as a pass: a ``.metadata`` asking for ``posix.system`` was valid)."""
    import errno
    import subprocess

    from raytrain_ckpt.checkpoint.format import sandbox
    from raytrain_ckpt.checkpoint.format.unpickling import MetadataChecks

    monkeypatch.setenv(scancache.CACHE_ENV, "0")
    scancache.forget()
    unsafe = b"\x80\x04cposix\nsystem\n."
    checks = MetadataChecks([(MEMO_BOMB, "s1/.metadata", None), (unsafe, "s2/.metadata", None)])
    _exited(checks._batch.reader._proc)

    def no_process(*args, **kwargs):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    real = subprocess.Popen
    monkeypatch.setattr(sandbox.subprocess, "Popen", no_process)
    answers = checks.results()
    monkeypatch.setattr(sandbox.subprocess, "Popen", real)
    assert isinstance(answers[0], InvalidCheckpoint) and "needed over" in str(answers[0]), answers
    assert isinstance(answers[1], InvalidCheckpoint), answers
    assert "s2/.metadata: not checked, the reader process failed" in str(answers[1]), answers[1]
    sandbox.decode_in_sandbox("pickle", pickle.dumps([1, 2]), "after")  # a fresh reader serves on
    with pytest.raises((UnsafeCheckpoint, InvalidCheckpoint), match="posix.system"):
        sandbox.decode_in_sandbox("metadata", unsafe, "again")


def test_a_step_the_registry_checked_is_loaded_without_decoding_its_metadata_again(tmp_path, monkeypatch):
    """The registry's check of a step (the resume plan), like ``ls``'s, decodes its ``.metadata``
    in the reader process under the limits loading uses: loading that file next does not decode
    it there again (its content is the key), and without that verdict it does."""
    from raytrain_ckpt.checkpoint.format import sandbox
    from raytrain_ckpt.checkpoint.format.metadata import read_metadata
    from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

    step = _dcp_step(tmp_path / "job")
    assert list(CheckpointLayout(tmp_path / "job").valid_steps("size")) == [3]
    decoded: list[str] = []
    real = sandbox.decode_in_sandbox
    monkeypatch.setattr(sandbox, "decode_in_sandbox",
                        lambda kind, data, where, *rest, **kw: decoded.append(where) or real(kind, data, where, *rest, **kw))
    assert "model.0.weight" in read_metadata(step).state_dict_metadata
    assert decoded == []
    scancache.forget()
    read_metadata(step)
    assert decoded == [str(step / ".metadata")]


def test_steps_holding_the_same_metadata_bytes_are_checked_once_together(tmp_path, monkeypatch):
    """The saves of one plan often write byte-identical ``.metadata`` files: a group of them is
    checked once in the reader process (as one by one, where the first pass is remembered), and
    every step gets that verdict; a refused one is refused for each step holding it."""
    from raytrain_ckpt.checkpoint.format import sandbox
    from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

    root = tmp_path / "job"
    first = _dcp_step(root, 1)
    for step in (2, 3):
        _replace_metadata(_dcp_step(root, step), (first / ".metadata").read_bytes())
    for step in (4, 5):
        _replace_metadata(_dcp_step(root, step), b"\x80\x04cposix\nsystem\n.")
    sent: list[int] = []
    real = sandbox.submit_decodes
    monkeypatch.setattr(sandbox, "submit_decodes", lambda kind, jobs, *a: sent.append(len(jobs)) or real(kind, jobs, *a))
    layout = CheckpointLayout(root)
    verdicts = layout.verify_many([layout.step_dir(s) for s in range(1, 6)], "size")
    assert sent == [2]
    assert [isinstance(v, Manifest) and v.step for v in verdicts[:3]] == [1, 2, 3]
    assert all(isinstance(v, InvalidCheckpoint) and "posix.system" in str(v) for v in verdicts[3:])


def test_the_prescan_and_the_decode_run_with_the_collector_paused():
    # A scan or decode allocates an object or more per opcode, none in a cycle; each full collection
    # it triggered walked them all (a 7.9 MB .metadata's scan: 342 ns a byte with the collector on,
    # 216 paused). Neither sets one off now, and the collector is on again after each.
    import gc

    from raytrain_ckpt.checkpoint.format.prescan import scan_pickle
    from raytrain_ckpt.checkpoint.format.unpickling import _CheckingUnpickler, unpickle

    data = pickle.dumps([(f"key-{i}", [i, i + 1.5, (i, str(i))]) for i in range(50_000)], protocol=2)
    runs: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(count)
    try:
        assert gc.isenabled()
        scan_pickle(data, "big")
        unpickle(_CheckingUnpickler(io.BytesIO(data)), "big")
        # at most the one young collection each block's allocations set off once the collector is back
        assert len(runs) <= 2 and 2 not in runs and gc.isenabled()
        runs.clear()
        pickle.loads(data)  # the decode's work with the collector on: a collection every 700 allocations
        assert len(runs) > 20
    finally:
        gc.callbacks.remove(count)
