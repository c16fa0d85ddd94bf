"""Staging buffer files: exclusive creation, checked mapping, and the ownership lock that lets
orphans of dead processes be swept while live buffers are never touched. Real files, real
processes (SIGKILLed), the real CLI; every sweep runs in a private directory."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.datapath.buffers import BufferLease, is_leased, OwnedBuffer, sweep_orphans

from raytrain_ckpt.checkpoint.errors import StagingFileError
from raytrain_ckpt.checkpoint.datapath.staging import allocate_buffer, map_buffer

REPO = Path(__file__).resolve().parents[2]
_HOLDER = """
import sys
from pathlib import Path
from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer
held = [OwnedBuffer.create(Path(p), 4096 * (i + 1)) for i, p in enumerate(sys.argv[1:])]
print("ready", flush=True)
sys.stdin.read()
"""


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _holder(*paths: Path) -> subprocess.Popen:
    """A real process that creates and owns buffers at ``paths``; returns once they exist."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, *map(str, paths)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "raytrain_ckpt", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture
def umask_0() -> Iterator[None]:
    old = os.umask(0)
    yield
    os.umask(old)


def test_created_buffers_are_0600_whatever_the_umask(tmp_path: Path, umask_0: None) -> None:
    buf = allocate_buffer(tmp_path / "rtc-a.buf", 1000)
    assert _mode(buf.path) == 0o600 and os.stat(buf.path).st_size == 1000
    buf.remove()
    assert not buf.path.exists()


def test_a_symlink_planted_at_the_name_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 100)
    link = tmp_path / "rtc-a.buf"
    link.symlink_to(victim)
    with pytest.raises(StagingFileError, match="rtc-a.buf already exists and is a symlink"):
        allocate_buffer(link, 1 << 20)
    assert victim.read_bytes() == b"precious" * 100 and link.is_symlink()


def test_a_pre_created_world_readable_file_is_not_adopted(tmp_path: Path) -> None:
    path = tmp_path / "rtc-a.buf"
    path.write_bytes(b"x" * 10)
    os.chmod(path, 0o644)
    with pytest.raises(StagingFileError, match="has mode 644, not 600"):
        allocate_buffer(path, 1 << 20)
    assert path.read_bytes() == b"x" * 10 and _mode(path) == 0o644


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_another_users_file_is_neither_adopted_nor_mapped(tmp_path: Path) -> None:
    path = tmp_path / "rtc-a.buf"
    path.write_bytes(b"\0" * 4096)
    os.chmod(path, 0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(StagingFileError, match="is owned by uid 65534"):
        allocate_buffer(path, 4096)
    with pytest.raises(StagingFileError, match="is owned by uid 65534"):
        map_buffer(path, 4096)
    assert path.exists()


def test_mapping_refuses_a_symlink_a_loose_mode_and_a_short_file(tmp_path: Path) -> None:
    buf = allocate_buffer(tmp_path / "rtc-a.buf", 4096)
    link = tmp_path / "rtc-link.buf"
    link.symlink_to(buf.path)
    with pytest.raises(StagingFileError, match="is a symlink"):
        map_buffer(link, 4096)
    with pytest.raises(StagingFileError, match="holds 4096 bytes, expected 8192"):
        map_buffer(buf.path, 8192)
    os.chmod(buf.path, 0o644)
    with pytest.raises(StagingFileError, match="has mode 644"):
        map_buffer(buf.path, 4096)
    os.chmod(buf.path, 0o600)
    assert map_buffer(buf.path, 4096).numel() == 4096


def test_a_live_owners_name_is_an_error_a_dead_owners_is_reclaimed(tmp_path: Path) -> None:
    path = tmp_path / "rtc-a.buf"
    holder = _holder(path)
    try:
        with pytest.raises(StagingFileError, match="in use by a live process"):
            allocate_buffer(path, 4096)
        assert path.exists()
    finally:
        _kill(holder)
    buf = allocate_buffer(path, 100)       # the dead owner's file is an orphan: replaced, not reused
    assert os.stat(path).st_size == 100 and _mode(path) == 0o600
    buf.remove()


def test_sweep_removes_a_killed_processs_buffers_and_leaves_a_live_ones(tmp_path: Path) -> None:
    dead = [tmp_path / "rtc-jobA-a0-rank0.buf", tmp_path / "rtc-jobA-a0-rank1.buf"]
    alive = [tmp_path / "rtc-jobB-a0-rank0.buf"]
    not_ours = tmp_path / "rtc-loose.buf"
    not_ours.write_bytes(b"y")                 # 0644: never created by a writer, never swept
    a, b = _holder(*dead), _holder(*alive)
    try:
        assert sweep_orphans(tmp_path) == []   # both owners alive
        _kill(a)
        assert sorted(o.path for o in sweep_orphans(tmp_path, dry_run=True)) == dead
        assert all(p.exists() for p in dead)
        removed = sweep_orphans(tmp_path)
        assert sorted((o.path, o.nbytes) for o in removed) == [(dead[0], 4096), (dead[1], 8192)]
        assert not any(p.exists() for p in dead) and alive[0].exists() and not_ours.exists()
    finally:
        _kill(b)


def test_clean_buffers_command_lists_then_removes_only_orphans(tmp_path: Path) -> None:
    dead, alive = tmp_path / "rtc-jobA-a1-rank0.buf", tmp_path / "rtc-jobB-a0-rank0.buf"
    a, b = _holder(dead), _holder(alive)
    try:
        _kill(a)
        dry = _cli("clean-buffers", "--dry-run", "--dir", str(tmp_path))
        assert dry.returncode == 0, dry.stderr
        assert f"would remove {dead} (0.0 MB)" in dry.stdout and str(alive) not in dry.stdout
        assert dead.exists()
        real = _cli("clean-buffers", "--dir", str(tmp_path))
        assert real.returncode == 0, real.stderr
        assert f"removed {dead} (0.0 MB)" in real.stdout and "removed 1 orphaned staging buffer(s)" in real.stdout
        assert not dead.exists() and alive.exists()
    finally:
        _kill(b)


def test_clean_buffers_with_a_missing_dir_is_a_usage_error(tmp_path: Path) -> None:
    r = _cli("clean-buffers", "--dir", str(tmp_path / "nope"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a directory" in r.stderr
    assert "Traceback" not in r.stderr


def test_remove_leaves_a_file_that_replaced_ours_alone(tmp_path: Path) -> None:
    buf = OwnedBuffer.create(tmp_path / "rtc-a.buf", 64)
    buf.path.unlink()
    buf.path.write_bytes(b"someone else's")
    buf.remove()
    assert buf.path.read_bytes() == b"someone else's"


_LEASER = """
import sys
from pathlib import Path
from raytrain_ckpt.checkpoint.datapath.buffers import BufferLease
lease = BufferLease(Path(sys.argv[1]))
print("ready", flush=True)
sys.stdin.read()
"""


def _leaser(path: Path) -> subprocess.Popen:
    """A real process that leases the buffer at ``path`` (a trainer staging into it); returns once it does."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", _LEASER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_lease_is_seen_by_other_processes_and_ends_with_its_holder(tmp_path: Path) -> None:
    buf = allocate_buffer(tmp_path / "rtc-l.buf", 4096)
    try:
        assert not is_leased(buf.path)
        holder = _leaser(buf.path)
        assert is_leased(buf.path)
        with pytest.raises(StagingFileError, match="still leased"):
            _expect_lease_fails(buf.path)
        _kill(holder)                                      # SIGKILL: the kernel drops the lock
        assert not is_leased(buf.path)
        mine = BufferLease(buf.path)
        mine.release()
        assert not is_leased(buf.path)
    finally:
        buf.remove()


def _expect_lease_fails(path: Path) -> None:
    """Take a lease in another process (our own process's POSIX locks never conflict with each other)."""
    code = ("import sys\nfrom pathlib import Path\nfrom raytrain_ckpt.checkpoint.datapath.buffers import BufferLease\n"
            "BufferLease(Path(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.returncode != 0 and "still leased" in out.stderr:
        raise StagingFileError("still leased")


def _resident_kb(address: int) -> int:
    """Rss of this process's mapping that starts at ``address`` (from /proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}" and " " in line:
            return next(int(entry.split()[1]) for entry in lines[i + 1:] if entry.startswith("Rss:"))
    raise AssertionError(f"no mapping at {address:x}")


def test_prefault_maps_every_page_of_a_new_mapping_in_one_call(tmp_path: Path) -> None:
    import mmap

    import torch

    from raytrain_ckpt.checkpoint.datapath.staging import prefault

    nbytes = 8 << 20
    owned = allocate_buffer(tmp_path / "rtc-test-a0-rank0.buf", nbytes)
    try:
        map_buffer(owned.path, nbytes).fill_(7)  # another mapping wrote the file's pages
        with open(owned.path, "r+b") as f:  # a fresh mapping: none of them is mapped in it yet
            buffer = torch.frombuffer(mmap.mmap(f.fileno(), nbytes), dtype=torch.uint8)
        assert _resident_kb(buffer.data_ptr()) == 0
        assert prefault(buffer)
        assert _resident_kb(buffer.data_ptr()) == nbytes // 1024
        assert bool((buffer == 7).all())  # populated with the file's pages, not new ones
        buffer.copy_(torch.arange(nbytes, dtype=torch.int64).to(torch.uint8))
        assert torch.equal(map_buffer(owned.path, nbytes), buffer)  # writes still reach the shared file
    finally:
        owned.remove()


def test_the_last_mapping_is_kept_for_the_same_file_only(tmp_path: Path) -> None:
    """A surviving rank given its buffer back stages into the pages it mapped already; a new
    file under the same name, or another size, is mapped anew."""
    first = allocate_buffer(tmp_path / "rtc-test-a0-rank0.buf", 1 << 20)
    try:
        mapped = map_buffer(first.path, 1 << 20)
        assert map_buffer(first.path, 1 << 20) is mapped
        assert map_buffer(first.path, 4096) is not mapped
    finally:
        first.remove()
    second = allocate_buffer(tmp_path / "rtc-test-a0-rank0.buf", 1 << 20)  # the same name, a new file
    try:
        again = map_buffer(second.path, 1 << 20)
        assert again is not mapped
        again.fill_(3)
        assert bool((mapped == 0).all())  # the old file's pages are not the new file's
    finally:
        second.remove()


def test_reserve_allocates_the_memory_and_never_grows_the_file(tmp_path: Path) -> None:
    owned = OwnedBuffer.create(tmp_path / "rtc-x-a0-rank0.buf", 1 << 20)
    try:
        assert os.stat(owned.path).st_blocks * 512 >= 1 << 20  # backed in full before anyone maps it (issue 34)
        owned.reserve()
        st = os.stat(owned.path)
        assert st.st_size == 1 << 20 and st.st_blocks * 512 >= 1 << 20
        owned.resize(4096)
        owned.reserve()
        assert os.stat(owned.path).st_size == 4096
    finally:
        owned.remove()
    owned.reserve()  # after remove: nothing to allocate, no error


def test_a_rank_keeps_the_mappings_of_both_its_buffers(tmp_path: Path) -> None:
    """With two staging buffers (memory_copies: 2) a surviving rank gets both mappings back,
    and a third buffer mapped drops the oldest."""
    owned = [allocate_buffer(tmp_path / f"rtc-test-a0-rank0-c{c}.buf", 1 << 20) for c in range(3)]
    try:
        first, second = (map_buffer(o.path, 1 << 20, keep=2) for o in owned[:2])
        assert map_buffer(owned[0].path, 1 << 20, keep=2) is first
        assert map_buffer(owned[1].path, 1 << 20, keep=2) is second
        map_buffer(owned[2].path, 1 << 20, keep=2)
        assert map_buffer(owned[1].path, 1 << 20, keep=2) is second
        assert map_buffer(owned[0].path, 1 << 20, keep=2) is not first
    finally:
        for o in owned:
            o.remove()


def test_warm_populates_the_buffer_in_the_background_once(tmp_path: Path) -> None:
    """``warm()`` maps every page of a buffer not staged into yet; its first copy then walks
    nothing again, and a new staging of the same kept mapping does not either."""
    import torch

    from raytrain_ckpt.checkpoint.datapath.staging import SharedMemoryStaging, plan_slots

    nbytes = 8 << 20
    tensors = {"w": torch.arange(nbytes // 4, dtype=torch.float32)}
    slots, size = plan_slots(tensors)
    owned = allocate_buffer(tmp_path / "rtc-test-a0-rank0-c1.buf", size)
    try:
        buffer = map_buffer(owned.path, size)
        assert _resident_kb(buffer.data_ptr()) == 0
        staging = SharedMemoryStaging(buffer, slots)
        staging.warm()
        staging._populate.wait()
        assert _resident_kb(buffer.data_ptr()) == size // 1024
        populated = staging._populate._thread
        again = SharedMemoryStaging(map_buffer(owned.path, size), slots)  # a restarted rank's client
        assert again._populate is staging._populate
        done = []
        again.start(tensors, lambda: done.append(True))
        again.wait()
        assert done and again._populate._thread is populated  # not populated a second time
        start = slots[0].offset
        assert torch.equal(map_buffer(owned.path, size)[start:start + nbytes].view(torch.float32), tensors["w"])
    finally:
        owned.remove()


def test_the_staging_copy_makes_the_bytes_copy_makes_whatever_the_source() -> None:
    """``copy_bytes`` moves a plain source's bytes with ``memmove`` and leaves every other source
    (strided, another dtype, another shape to broadcast) to ``copy_``: the result is the same."""
    import torch

    from raytrain_ckpt.checkpoint.datapath.staging import copy_bytes

    torch.manual_seed(0)
    plain = torch.randn(64, 33)
    plain[0, :3] = torch.tensor([-0.0, float("nan"), float("inf")])
    sources = {"plain": plain, "strided": torch.randn(33, 64).t(), "float64": torch.randn(64, 33, dtype=torch.float64),
               "broadcast": torch.randn(1, 33), "offset": torch.randn(100, 33)[36:], "negated": plain._neg_view()}
    for name, src in sources.items():
        dst, want = torch.full((64, 33), 7.0), torch.full((64, 33), 7.0)
        copy_bytes(dst, src)
        want.copy_(src)
        assert torch.equal(dst.view(torch.int32), want.view(torch.int32)), name  # bit for bit, NaN and -0.0 too
    # a destination that is not plain either: a transposed view
    dst, want = torch.full((33, 64), 7.0), torch.full((33, 64), 7.0)
    copy_bytes(dst.t(), plain)
    want.t().copy_(plain)
    assert torch.equal(dst.view(torch.int32), want.view(torch.int32))


class _Wrapper(__import__("torch").Tensor):
    """A wrapper tensor subclass (as a quantised FSDP2 parameter's local shard is): device, layout
    and contiguity of its inner tensor, but no bytes of its own (``data_ptr`` 0)."""

    @staticmethod
    def __new__(cls, inner):
        import torch

        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        import torch.utils._pytree as pytree

        unwrap = lambda t: t.inner if isinstance(t, _Wrapper) else t  # noqa: E731
        return func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))


def test_the_staging_copy_leaves_tensors_without_bytes_of_their_own_to_copy() -> None:
    """A wrapper subclass, an efficient zero tensor and an empty tensor are never ``memmove``d
    (the first two have ``data_ptr`` 0: a memmove would read or write address 0 and kill the
    process); ``copy_`` copies them, in either direction."""
    import torch

    from raytrain_ckpt.checkpoint.datapath.staging import _plain, copy_bytes

    values = torch.randn(8, 4)
    wrapped = _Wrapper(values.clone())
    zeros = torch._efficientzerotensor(8, 4)
    assert wrapped.data_ptr() == 0 and zeros.data_ptr() == 0
    assert not _plain(wrapped) and not _plain(zeros) and not _plain(torch.empty(0, 4)) and _plain(values)
    dst = torch.full((8, 4), 7.0)
    copy_bytes(dst, wrapped)
    assert torch.equal(dst, values)
    copy_bytes(dst, zeros)
    assert torch.equal(dst, torch.zeros(8, 4))
    into = _Wrapper(torch.full((8, 4), 7.0))
    copy_bytes(into, values)
    assert torch.equal(into.inner, values)
    copy_bytes(torch.empty(0, 4), torch.empty(0, 4))


def test_the_staging_copy_copies_a_quantized_tensors_scale_and_a_nested_ones_parts() -> None:
    """Tensors whose values are not just their bytes go through ``copy_``: a quantized one's bytes
    alone would read back at the destination's scale."""
    import torch

    from raytrain_ckpt.checkpoint.datapath.staging import _plain, copy_bytes

    src = torch.quantize_per_tensor(torch.tensor([1.0, 2.0, 3.0, 4.0]), 0.1, 0, torch.qint8)
    dst = torch.quantize_per_tensor(torch.zeros(4), 0.5, 3, torch.qint8)
    assert not _plain(src) and not _plain(dst)
    copy_bytes(dst, src)
    assert torch.equal(dst.dequantize(), src.dequantize())
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    into = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    assert not _plain(nested)
    copy_bytes(into, nested)
    assert all(torch.equal(a, b) for a, b in zip(into.unbind(), nested.unbind()))
