"""The one-pass local writer produces plain DCP: the same files, items and lengths as DCP's
FileSystemWriter for the same plan, each file's items at the offsets DCP's would have with its
byte items moved after its tensors (large tensors' items start later, their bytes at
block-aligned offsets written in place with O_DIRECT), loaded by dcp.load and format_utils,
with a CRC-32C that is the checksum of every byte on disk."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer
from raytrain_ckpt.checkpoint.datapath import filewrite, localfile
from raytrain_ckpt.checkpoint.format.crc import address_of
from raytrain_ckpt.checkpoint.datapath.localfile import write_rank_files
from raytrain_ckpt.checkpoint.format.manifest import checksum_file
from raytrain_ckpt.checkpoint.datapath.staging import StagedPlanner, map_buffer, map_slots, plan_slots, slot_views


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
                      "empty": torch.zeros(0, 4), "step_t": torch.tensor(5, dtype=torch.int64)},
            "optim": {"lr": 0.1, "names": ["a", "b"]}, "step": 12}


def _plan_and_stage(state: dict, shm: Path):
    """One rank's central plan, metadata, and the staged tensors (in a real buffer file) + objects."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    central, metadata = planner.create_global_plan([planner.create_local_plan()])
    plan = planner.finish_plan(FileSystemWriter(shm).prepare_global_plan(central)[0])
    tensors = {k: v for k, v in planner.state_dict.items() if isinstance(v, torch.Tensor)}
    objects = {k: v for k, v in planner.state_dict.items() if not isinstance(v, torch.Tensor)}
    slots, nbytes = plan_slots(tensors)
    owned = OwnedBuffer.create(shm / "rtc-test-a0-rank0.buf", nbytes)
    for fqn, view in slot_views(map_buffer(owned.path, nbytes), slots).items():
        view.copy_(tensors[fqn])
    return plan, metadata, owned, slots, nbytes, objects


@pytest.mark.parametrize("threads", [1, 2])
def test_same_results_as_dcp_loadable_and_checksummed(tmp_path: Path, threads: int) -> None:
    state = _state()
    plan, metadata, owned, slots, nbytes, objects = _plan_and_stage(state, tmp_path)
    try:
        ours, theirs = tmp_path / "ours", tmp_path / "theirs"
        ours.mkdir(), theirs.mkdir()
        staged = {**map_slots(owned.path, nbytes, slots), **objects}
        written = write_rank_files(ours, plan, StagedPlanner(staged).resolve_data, threads)
        dcp_writer = FileSystemWriter(theirs, thread_count=threads)
        dcp_writer.set_up_storage_writer(True, rank=0)
        expected = dcp_writer.write_data(plan, StagedPlanner({**slot_views(map_buffer(owned.path, nbytes), slots),
                                                              **objects})).wait()
    finally:
        owned.remove()
    byte_keys = {_key(i) for i in plan.items if i.type == WriteItemType.BYTE_IO}
    assert sorted(((_key(r), r.size_in_bytes, r.storage_data) for r in written.results), key=str) == \
        sorted(((_key(r), r.size_in_bytes, r.storage_data) for r in _bytes_after_tensors(expected, byte_keys)),
               key=str)
    assert byte_keys and all(r.storage_data.offset > t.storage_data.offset  # byte items lie after the tensors
                             for r in written.results if _key(r) in byte_keys
                             for t in written.results if _key(t) not in byte_keys
                             and t.storage_data.relative_path == r.storage_data.relative_path)
    assert sorted(written.files) == sorted(p.name for p in theirs.iterdir())
    for name, entry in written.files.items():
        assert entry == {"size": (ours / name).stat().st_size, "crc32c": checksum_file(ours / name)}
        assert entry["size"] == (theirs / name).stat().st_size
    assert written.phases.fsync_s > 0 and written.phases.checksum_s > 0

    FileSystemWriter(ours).finish(metadata, [written.results])
    loaded = {"model": {k: torch.full_like(v, -1.0) for k, v in state["model"].items()},
              "optim": {"lr": 0.0, "names": []}, "step": 0}
    dcp.load(loaded, storage_reader=FileSystemReader(ours), no_dist=True)
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    assert loaded["optim"] == state["optim"] and loaded["step"] == 12
    dcp_to_torch_save(ours, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert torch.equal(whole["model"]["w"], state["model"]["w"])


def _bytes_after_tensors(results: list, byte_keys: set) -> list:
    """DCP's results with each file's byte items (``byte_keys``) moved after its tensors, every
    item's length kept: the offsets our writer records for the same items."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    out = []
    for name in sorted({r.storage_data.relative_path for r in results}):
        mine = sorted((r for r in results if r.storage_data.relative_path == name), key=lambda r: r.storage_data.offset)
        offset = 0
        for r in sorted(mine, key=lambda r: _key(r) in byte_keys):  # stable: plan order within each kind
            out.append(WriteResult(index=r.index, size_in_bytes=r.size_in_bytes,
                                   storage_data=_StorageInfo(name, offset, r.storage_data.length)))
            offset += r.storage_data.length
    return out


def _key(r) -> tuple:
    return (r.index.fqn, r.index.offset, r.index.index)


def test_slot_views_for_writing_own_exactly_their_bytes(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.float16)}
    slots, nbytes = plan_slots(tensors)
    owned = OwnedBuffer.create(tmp_path / "rtc-x-a0-rank0.buf", nbytes)
    try:
        for fqn, view in slot_views(map_buffer(owned.path, nbytes), slots).items():
            view.copy_(tensors[fqn])
        views = map_slots(owned.path, nbytes, slots)
    finally:
        owned.remove()
    for fqn, t in tensors.items():
        assert views[fqn].untyped_storage().nbytes() == t.nbytes and torch.equal(views[fqn], t)


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    state = {"w": torch.ones(4)}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    central, _ = planner.create_global_plan([planner.create_local_plan()])
    plan = planner.finish_plan(FileSystemWriter(tmp_path).prepare_global_plan(central)[0])
    (tmp_path / "__0_0.distcp").write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        write_rank_files(tmp_path, plan, planner.resolve_data)
    assert (tmp_path / "__0_0.distcp").read_bytes() == b"keep"


def _zip_crcs(directory: Path, results) -> list[int]:
    """The CRC-32 field of every zip record of every tensor item ``results`` name."""
    import zipfile

    crcs = []
    for r in results:
        info = r.storage_data
        raw = (directory / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        if raw[:4] == b"PK\x03\x04":  # a tensor's torch.save zip (a byte item is a bare pickle)
            crcs += [record.CRC for record in zipfile.ZipFile(io.BytesIO(raw)).infolist() if record.file_size]
    return crcs


def _two_ranks_at_once(tmp_path: Path, threads: int, rank0_here: bool = False) -> dict:
    """Write two ranks' states at once, each on a thread of its own (rank 0 on the calling thread
    with ``rank0_here``) as one writer writes a node's ranks; returns, per rank, its
    ``RankFiles`` and (rank, "setting"): its thread's CRC setting right after its write."""
    import threading

    state = _state()
    state["model"]["big"] = torch.randn(1 << 20)
    plan, _, owned, slots, nbytes, objects = _plan_and_stage(state, tmp_path)
    staged = {**map_slots(owned.path, nbytes, slots), **objects}
    start, written, errors = threading.Barrier(2, timeout=60), {}, []

    def write(rank: int) -> None:
        try:
            out = tmp_path / f"rank{rank}"
            out.mkdir()
            start.wait()
            written[rank] = write_rank_files(out, plan, StagedPlanner(staged).resolve_data, threads)
            written[rank, "setting"] = torch.serialization.get_crc32_options()
        except BaseException as exc:  # raised on the test's thread below
            errors.append(exc)

    try:
        others = [threading.Thread(target=write, args=(rank,)) for rank in ((1,) if rank0_here else (0, 1))]
        for t in others:
            t.start()
        if rank0_here:
            write(0)
        for t in others:
            t.join()
    finally:
        owned.remove()
    assert not errors, errors
    for rank in (0, 1):
        crcs = _zip_crcs(tmp_path / f"rank{rank}", written[rank].results)
        assert len(crcs) >= 5 * 4 and set(crcs) == {0}, (rank, crcs)  # 5 tensors, >= 4 records each
    return written


@pytest.mark.parametrize("setting", ["per thread", "process-wide"])
@pytest.mark.parametrize("threads", [1, 2])
def test_no_write_computes_the_zip_crc_on_whatever_thread_it_runs(tmp_path: Path, monkeypatch, threads: int,
                                                                  setting: str) -> None:
    """Two ranks written at once (with ``threads`` files each, on threads of their own too):
    torch's zip CRC-32 is computed for no record (the manifest's CRC-32C covers the bytes), and
    every thread's setting is back after. torch's setting is per thread (torch 2.13 on); a
    process-wide one (torch before it) is emulated by replacing torch's getter and setter, which
    ``torch.save`` calls."""
    import threading

    monkeypatch.setattr(filewrite, "_crc_per_thread", None)  # found out again, for this setting
    if setting == "process-wide":
        value = [True]
        monkeypatch.setattr(torch.serialization, "get_crc32_options", lambda: value[0])
        monkeypatch.setattr(torch.serialization, "set_crc32_options", lambda on: value.__setitem__(0, on))
    written = _two_ranks_at_once(tmp_path, threads)
    if setting == "per thread":  # (process-wide, it stays off until the other write is done too)
        assert written[0, "setting"] is True and written[1, "setting"] is True
    fresh = []
    probe = threading.Thread(target=lambda: fresh.append(torch.serialization.get_crc32_options()))
    probe.start()
    probe.join()
    assert torch.serialization.get_crc32_options() is True and fresh == [True]
    assert filewrite._crc_per_thread is (setting == "per thread")


def test_a_write_from_a_thread_whose_crc_is_off_leaves_every_thread_as_it_was(tmp_path: Path, monkeypatch) -> None:
    """The first write of a process comes from a thread that had turned torch's CRC off for itself
    while another thread writes at the same time: neither computes the zip CRC-32, and each
    thread's setting is what it was before (off here, on there)."""
    monkeypatch.setattr(filewrite, "_crc_per_thread", None)
    torch.serialization.set_crc32_options(False)  # this thread's own (torch 2.13: per thread)
    try:
        written = _two_ranks_at_once(tmp_path, 1, rank0_here=True)
    finally:
        torch.serialization.set_crc32_options(True)
    assert written[0, "setting"] is False and written[1, "setting"] is True


FAILING_WRITE = """
import resource, signal, sys
from pathlib import Path
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from raytrain_ckpt.checkpoint.datapath import localfile
from raytrain_ckpt.checkpoint.datapath.localfile import write_rank_files

out = Path(sys.argv[1])
if int(sys.argv[2]):                            # aligned buffers smaller than the file: the failing write
    localfile._BOUNCE = int(sys.argv[2])        # is one of several, made while the next buffer fills
planner = DefaultSavePlanner()
planner.set_up_planner({"w": torch.ones(int(sys.argv[3]))}, is_coordinator=True)
central, _ = planner.create_global_plan([planner.create_local_plan()])
plan = planner.finish_plan(FileSystemWriter(out).prepare_global_plan(central)[0])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:
    write_rank_files(out, plan, planner.resolve_data)
except OSError as exc:
    print("raised", exc.errno, torch.serialization.get_crc32_options(), flush=True)
import gc
gc.collect()                                    # a zip writer finishing late would abort the process here
print("alive")
"""


@pytest.mark.parametrize("bounce,numel", [(0, 64 * 1024), (64 << 10, 64 * 1024), (0, 1 << 20)])
def test_a_failed_write_raises_and_restores_the_crc_setting(tmp_path: Path, bounce: int, numel: int) -> None:
    """A real short write (the file size limit: EFBIG, like ENOSPC a write that fails midway); with
    a 4 MiB tensor, the write that crosses the limit is one made in place from the tensor's memory."""
    import errno
    import subprocess
    import sys

    args = [str(tmp_path), str(bounce), str(numel)]
    out = subprocess.run([sys.executable, "-c", FAILING_WRITE, *args], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parents[2])
    assert out.stdout.split() == ["raised", str(errno.EFBIG), "True", "alive"], out.stderr[-2000:]
    assert out.returncode == 0, out.stderr[-2000:]


def _cached_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file), from mincore(2) on a mapping."""
    import ctypes
    import mmap

    import numpy as np

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        pages = (len(m) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        address = np.frombuffer(m, dtype=np.uint8).ctypes.data
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(m)), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec), pages


def _on_tmpfs(path: Path) -> bool:
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    best = max((m for m in mounts if str(path.resolve()).startswith(m[1])), key=lambda m: len(m[1]))
    return best[2] in ("tmpfs", "ramfs")


def test_written_files_leave_the_page_cache(tmp_path: Path) -> None:
    """A written file's pages leave the page cache after its fsync (on tmpfs the cache is the
    data, which stays)."""
    if _on_tmpfs(tmp_path):
        pytest.skip("tmp_path is on tmpfs: its page cache is the file")
    g = torch.Generator().manual_seed(1)
    state = {"model": {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(8)}}  # 32 MiB
    plan, _, owned, slots, nbytes, objects = _plan_and_stage(state, tmp_path)
    try:
        out = tmp_path / "out"
        out.mkdir()
        written = write_rank_files(out, plan, StagedPlanner({**map_slots(owned.path, nbytes, slots), **objects})
                                   .resolve_data)
    finally:
        owned.remove()
    (name, entry), = written.files.items()
    cached, pages = _cached_pages(out / name)
    assert pages > 8000 and cached < pages // 10, (cached, pages)
    assert checksum_file(out / name) == entry["crc32c"]  # and what is on disk is what was written


def _write_state(directory: Path, state: dict) -> dict[str, bytes]:
    directory.mkdir()
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    central, _ = planner.create_global_plan([planner.create_local_plan()])
    plan = planner.finish_plan(FileSystemWriter(directory).prepare_global_plan(central)[0])
    written = write_rank_files(directory, plan, planner.resolve_data)
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert {n: {"size": len(b), "crc32c": checksum_file(directory / n)} for n, b in files.items()} == written.files
    return files


@pytest.mark.parametrize("align", [filewrite.DIRECT_ALIGN, 100])
def test_direct_writes_make_the_bytes_the_page_cache_writes_make(tmp_path: Path, monkeypatch, align: int) -> None:
    """Through O_DIRECT (a full aligned buffer, then a tail that is not a whole block) the files are
    the bytes the page-cache path writes. With an alignment the device does not have (100), the file
    system really refuses the direct write (EINVAL) and the rest of the file goes through the cache."""
    import fcntl
    import os

    fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        if not localfile._try_direct(fd):
            pytest.skip(f"{tmp_path}: no O_DIRECT on this file system")
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        os.close(fd)
    state = {"a": torch.arange(localfile._BOUNCE // 4 + 1000, dtype=torch.float32), "b": torch.ones(30_000),
             "c": torch.arange(7), "step": 3}
    monkeypatch.setattr(localfile, "DIRECT_ALIGN", align)
    direct = _write_state(tmp_path / "direct", state)
    monkeypatch.setattr(localfile, "_try_direct", lambda fd: False)
    assert direct == _write_state(tmp_path / "cached", state)


def test_direct_writes_through_many_small_buffers_make_the_same_bytes(tmp_path: Path, monkeypatch) -> None:
    """With buffers far smaller than the state, each of the two is filled, written and reused many
    times while the other is written: the files are still the bytes the page-cache path writes."""
    _needs_direct(tmp_path)
    monkeypatch.setattr(localfile, "_BOUNCE", 64 << 10)
    state = {"a": torch.randn(300_000), "b": torch.arange(70_001, dtype=torch.int64), "c": torch.ones(3), "step": 9}
    direct = _write_state(tmp_path / "direct", state)
    monkeypatch.setattr(localfile, "_try_direct", lambda fd: False)
    assert direct == _write_state(tmp_path / "cached", state)


def _needs_direct(path: Path) -> None:
    import os

    fd = os.open(path / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        if not localfile._try_direct(fd):
            pytest.skip(f"{path}: no O_DIRECT on this file system")
    finally:
        os.close(fd)
        (path / "probe").unlink()


def _data_offsets(directory: Path, results) -> dict[str, int]:
    """File offset of each tensor item's storage bytes (its zip record ``data/0``), from the file."""
    import struct
    import zipfile

    out = {}
    for r in results:
        info = r.storage_data
        raw = (directory / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        records = [i for i in zipfile.ZipFile(io.BytesIO(raw)).infolist() if i.filename.endswith("/data/0")]
        if not records:
            continue  # a byte item (a pickled object, no storage)
        record, = records
        names, extra = struct.unpack("<HH", raw[record.header_offset + 26:record.header_offset + 30])
        out[r.index.fqn] = info.offset + record.header_offset + 30 + names + extra
    return out


def _big_state() -> dict:
    """Tensors of 1 MiB and more (written in place) of odd sizes, with small ones between them."""
    g = torch.Generator().manual_seed(11)
    return {"model": {"a": torch.randn(3_000_001, generator=g), "b": torch.randn(1000, generator=g),
                      "c": torch.randn(700_001, generator=g).to(torch.bfloat16),
                      "d": torch.arange(5 << 20, dtype=torch.int32), "e": torch.ones(262_144)},
            "step": 4, "names": ["x"], "blob": bytes(range(256)) * 12_000}  # a 3 MB byte item: never in place


@pytest.mark.parametrize("threads", [1, 2])
def test_large_tensors_go_to_the_device_from_the_staging_buffer(tmp_path: Path, monkeypatch, threads: int) -> None:
    """The whole blocks of every tensor of 1 MiB or more are written with O_DIRECT straight from
    the staging buffer, at 4096-aligned file offsets (padding before their items); the files are
    the page-cache path's bytes, load with dcp.load, the safe reader and format_utils, and the
    buffer's CRC-32C derived from the write's spans is the CRC-32C of its bytes."""
    import crc32c

    from raytrain_ckpt.checkpoint.format.crc import region_crc
    from raytrain_ckpt.checkpoint.format.metadata import safe_reader
    from raytrain_ckpt.checkpoint.datapath.staging import map_whole, views_of

    _needs_direct(tmp_path)
    state = _big_state()
    plan, metadata, owned, slots, nbytes, objects = _plan_and_stage(state, tmp_path)
    in_place: list[tuple[int, int]] = []
    drain = localfile._DirectFileSink._drain

    def spy(self, views, offset, owners):  # every segment of every write (the buffer's own: in place)
        in_place.extend((address_of(v), v.nbytes) for v in views)
        return drain(self, views, offset, owners)

    try:
        whole = map_whole(owned.path, nbytes)
        base = address_of(whole)
        monkeypatch.setattr(localfile._DirectFileSink, "_drain", spy)
        direct_dir, cached_dir = tmp_path / "direct", tmp_path / "cached"
        direct_dir.mkdir(), cached_dir.mkdir()
        resolve = StagedPlanner({**views_of(whole, slots), **objects}).resolve_data  # as the writer maps it
        written = write_rank_files(direct_dir, plan, resolve, threads)
        buffer_crc = region_crc(whole, base, written.spans)
        assert buffer_crc == crc32c.crc32c(whole)
        monkeypatch.setattr(localfile, "_try_direct", lambda fd: False)
        cached = write_rank_files(cached_dir, plan, resolve, threads)
    finally:
        owned.remove()

    big = {s.fqn: s for s in slots if s.nbytes >= filewrite.IN_PLACE}
    assert sorted(big) == ["model.a", "model.c", "model.d", "model.e"]
    for fqn, slot in big.items():  # every whole block of the slot went from the buffer itself
        start, end = base + slot.offset, base + slot.offset + slot.nbytes // 4096 * 4096
        covered = sum(min(end, a + n) - max(start, a) for a, n in in_place if a < end and a + n > start)
        assert covered == end - start, fqn
    offsets = _data_offsets(direct_dir, written.results)
    assert all(offsets[fqn] % 4096 == 0 for fqn in big), offsets
    assert offsets["model.b"] % 4096 != 0  # small tensors are not padded
    for name, entry in written.files.items():
        assert (direct_dir / name).read_bytes() == (cached_dir / name).read_bytes()
        assert entry == {"size": (direct_dir / name).stat().st_size, "crc32c": checksum_file(direct_dir / name)}
    assert written.files == cached.files

    FileSystemWriter(direct_dir).finish(metadata, [written.results])
    for reader in (FileSystemReader(direct_dir), safe_reader(direct_dir)):
        loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0, "names": [],
                  "blob": b""}
        dcp.load(loaded, storage_reader=reader, no_dist=True)
        for k, v in state["model"].items():
            assert torch.equal(loaded["model"][k], v), k
        assert loaded["step"] == 4 and loaded["names"] == ["x"] and loaded["blob"] == state["blob"]
    dcp_to_torch_save(direct_dir, tmp_path / "whole.pt")
    whole_pt = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert all(torch.equal(whole_pt["model"][k], v) for k, v in state["model"].items())


def test_tensors_not_page_aligned_in_memory_are_placed_at_their_address_modulo_a_block(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """Live tensors (not staged; one a view of a larger storage, written from a temporary clone):
    each large tensor's bytes land at a file offset equal to its address modulo 4096, and the
    files load and carry their bytes' CRC-32C, through O_DIRECT and through the page cache. (The
    clone's address, and so the zeros before its item, may differ from one write to the next.)"""
    _needs_direct(tmp_path)
    g = torch.Generator().manual_seed(2)
    state = {"odd": torch.randn(2_000_000, generator=g)[3:1_500_000], "w": torch.randn(1_234_567, generator=g),
             "step": 1}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    central, metadata = planner.create_global_plan([planner.create_local_plan()])
    for direct in (True, False):
        out = tmp_path / f"direct={direct}"
        out.mkdir()
        if not direct:
            monkeypatch.setattr(localfile, "_try_direct", lambda fd: False)
        plan = planner.finish_plan(FileSystemWriter(out).prepare_global_plan(central)[0])
        written = write_rank_files(out, plan, planner.resolve_data)
        assert _data_offsets(out, written.results)["w"] % 4096 == state["w"].data_ptr() % 4096
        for name, entry in written.files.items():
            assert entry == {"size": (out / name).stat().st_size, "crc32c": checksum_file(out / name)}
        FileSystemWriter(out).finish(metadata, [written.results])
        loaded = {"odd": torch.zeros(1_499_997), "w": torch.zeros(1_234_567), "step": 0}
        dcp.load(loaded, storage_reader=FileSystemReader(out), no_dist=True)
        assert torch.equal(loaded["odd"], state["odd"]) and torch.equal(loaded["w"], state["w"])
        assert loaded["step"] == 1
