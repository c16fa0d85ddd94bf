"""Everything read from a checkpoint or an input file is bounded work: a pickle is pre-scanned
for the work it would do before any unpickler sees it, no allowed global allocates from a number
the file gives, and every tensor is tiled exactly by its chunks before anything is allocated.

The commands run in a subprocess with a time limit and an address-space limit: on the old code
they spin forever, allocate gigabytes, or export uninitialised memory as weights."""

from __future__ import annotations

import io
import os
import pickle
import resource
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from raytrain_ckpt.checkpoint.errors import BadEnvironment, InvalidCheckpoint, UnsafeCheckpoint
from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest, describe_file
from raytrain_ckpt.checkpoint.format.metadata import load_metadata
from raytrain_ckpt.checkpoint.format.prescan import BUDGET_ENV, check_pickle, check_torch_save
from raytrain_ckpt.checkpoint.format.unpickling import check_metadata_file
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

REPO = Path(__file__).resolve().parents[2]
SECONDS = 60
ADDRESS_SPACE = 6 << 30  # torch's import maps ~2 GB; a refusal never needs more


def _bounded(*args: str, timeout: float = SECONDS) -> subprocess.CompletedProcess:
    """``python -m raytrain_ckpt ARGS`` with a time and an address-space limit; a hang fails the test."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        return subprocess.run([sys.executable, "-m", "raytrain_ckpt", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"raytrain-ckpt {' '.join(args)} ran over {timeout}s (unbounded work on a checkpoint's bytes)")


def _dcp_step(root: Path, step: int = 3) -> Path:
    layout = CheckpointLayout(root)
    tmp = layout.new_tmp_dir(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step},
                 checkpoint_id=str(tmp), no_dist=True)
    files = {p.name: describe_file(p) for p in sorted(tmp.iterdir())}
    return layout.commit(tmp, Manifest(step=step, world_size=1, dp_size=1, spec_hash="h", files=files))


def _replace_metadata(step: Path, data: bytes) -> None:
    """Write ``data`` as the step's ``.metadata`` and record it in the manifest (so the step's
    files all check out: only what the metadata says is wrong)."""
    (step / ".metadata").write_bytes(data)
    manifest = Manifest.from_json((step / MANIFEST).read_text())
    fields = manifest.model_dump(mode="json", exclude_none=True)
    fields["files"][".metadata"] = describe_file(step / ".metadata")
    (step / MANIFEST).write_text(Manifest.model_validate(fields).to_json())


def _shared_nest(levels: int = 60) -> bytes:
    """A tuple nested ``levels`` deep whose every level holds the level below twice (memo references)."""
    return b")q\xc8" + b"0h\xc8h\xc8\x86q\xc8" * levels


def _metadata_keyed_by_a_nest(levels: int = 60) -> bytes:
    """DCP ``Metadata`` whose ``planner_data`` is a dict keyed by a shared nest: hashing the key
    walks 2^levels tuples."""
    return (b"\x80\x04\x8c\x25torch.distributed.checkpoint.metadata\x8c\x08Metadata\x93)\x81}(\x8c\x0cplanner_data}"
            + _shared_nest(levels) + b"K\x01su" + b"b.")


def test_the_nest_is_a_small_file():
    assert len(_metadata_keyed_by_a_nest()) < 600


@pytest.mark.parametrize("command", ["ls", "status", "verify", "export"])
def test_a_metadata_keyed_by_a_shared_nest_is_refused_in_bounded_time(tmp_path, command):
    step = _dcp_step(tmp_path / "job")
    _replace_metadata(step, _metadata_keyed_by_a_nest())
    args = {"ls": ["ls", str(step.parent)], "status": ["status", str(step.parent)], "verify": ["verify", str(step)],
            "export": ["export", str(step), "--format", "torch", "--out", str(tmp_path / "out")]}[command]
    out = _bounded(*args)
    text = out.stdout + out.stderr
    assert "Traceback" not in text
    if command in ("verify", "export"):
        assert out.returncode != 0
        assert "shared references" in text, text
    assert not (tmp_path / "out").exists()


def test_a_nest_inside_a_torch_save_file_is_refused_before_torch_reads_it(tmp_path):
    buf = io.BytesIO()
    torch.save({}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(tmp_path / "w.pt", "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                data = b"\x80\x02}" + _shared_nest() + b"K\x01s."
            out.writestr(info, data)
    assert (tmp_path / "w.pt").stat().st_size < 2048
    with open(tmp_path / "w.pt", "rb") as f, pytest.raises(InvalidCheckpoint, match="shared references"):
        check_torch_save(f, "w.pt")
    out = _bounded("import", str(tmp_path / "w.pt"), "--to", str(tmp_path / "ckpt"))
    assert out.returncode == 2, out.stderr
    assert "shared references" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "ckpt" / "step-00000000").exists()


BYTEARRAY_OF_A_LENGTH = b"\x80\x04\x8c\x08builtins\x8c\x09bytearray\x93\x8a\x05\x00\x00\x00\x00\x01\x85R."
"""34 bytes: ``bytearray(2**32)``, 4 GiB, from an allowed global."""


def test_an_allowed_global_never_allocates_from_a_length(tmp_path):
    assert len(BYTEARRAY_OF_A_LENGTH) <= 36
    path = tmp_path / ".metadata"
    path.write_bytes(BYTEARRAY_OF_A_LENGTH)
    with pytest.raises(UnsafeCheckpoint, match="length"):
        check_metadata_file(path)
    with pytest.raises(UnsafeCheckpoint, match="length"):
        load_metadata(io.BytesIO(BYTEARRAY_OF_A_LENGTH), "x")
    step = _dcp_step(tmp_path / "job")
    _replace_metadata(step, BYTEARRAY_OF_A_LENGTH)
    out = _bounded("verify", str(step))
    assert out.returncode == 1 and "length" in out.stdout + out.stderr, out.stdout + out.stderr


def test_a_bytearray_pickled_as_bytes_still_loads():
    from raytrain_ckpt.checkpoint.format.unpickling import data_bytearray

    for proto in range(6):
        assert pickle.loads(pickle.dumps(bytearray(b"ab"), protocol=proto)) == data_bytearray(b"ab")
    assert data_bytearray("ab", "latin-1") == bytearray(b"ab")


def _metadata_with(step: Path, change) -> bytes:
    with open(step / ".metadata", "rb") as f:
        md = load_metadata(f, "x")
    change(md)
    return pickle.dumps(md)


def test_a_tensor_declared_larger_than_its_chunks_is_never_exported(tmp_path):
    step = _dcp_step(tmp_path / "job")

    def grow(md) -> None:
        md.state_dict_metadata["model.0.weight"].size = torch.Size([3000, 4])

    _replace_metadata(step, _metadata_with(step, grow))
    out = _bounded("verify", str(step))
    assert out.returncode == 1 and "model.0.weight" in out.stdout + out.stderr
    out = _bounded("export", str(step), "--format", "torch", "--out", str(tmp_path / "m"), "--verify", "size")
    assert out.returncode != 0, out.stdout + out.stderr
    assert "model.0.weight" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "m").exists()


CHUNK_DEFECTS = {
    "overlap": lambda md: setattr(md.state_dict_metadata["model.0.weight"], "chunks",
                                  md.state_dict_metadata["model.0.weight"].chunks * 2),
    "outside": lambda md: setattr(md.state_dict_metadata["model.0.bias"].chunks[0], "offsets", torch.Size([2])),
    "bytes_past_the_file": lambda md: [setattr(info, "offset", 10**9) for info in md.storage_data.values()],
    "bytes_too_few": lambda md: [setattr(info, "length", 1) for info in md.storage_data.values()],
}


@pytest.mark.parametrize("defect", sorted(CHUNK_DEFECTS))
def test_a_chunk_layout_that_does_not_tile_its_tensor_is_refused(tmp_path, defect):
    from raytrain_ckpt.checkpoint.format.chunks import layout_problem
    from raytrain_ckpt.checkpoint.format.verify import verify_step
    from raytrain_ckpt.checkpoint.storage.backends import open_storage

    step = _dcp_step(tmp_path / "job")
    with open(step / ".metadata", "rb") as f:
        assert layout_problem(load_metadata(f, "x")) is None
    _replace_metadata(step, _metadata_with(step, CHUNK_DEFECTS[defect]))
    with pytest.raises(InvalidCheckpoint, match="tensor"):
        verify_step(step, "size", open_storage(step))


def test_a_real_step_passes_every_check(tmp_path):
    from raytrain_ckpt.checkpoint.format.verify import verify_step
    from raytrain_ckpt.checkpoint.storage.backends import open_storage

    step = _dcp_step(tmp_path / "job")
    verify_step(step, "checksum", open_storage(step))
    check_pickle((step / ".metadata").read_bytes(), "x")
    out = _bounded("export", str(step), "--format", "torch", "--out", str(tmp_path / "m"), "--with-optimizer")
    assert out.returncode == 0, out.stderr


def test_the_budget_is_raised_by_a_factor(monkeypatch):
    nest = b"\x80\x02" + _shared_nest(24) + b"."  # 2^25 = 33.5M nodes: under the 50M default
    check_pickle(nest, "x")
    deeper = b"\x80\x02" + _shared_nest(26) + b"."  # 134M nodes
    with pytest.raises(InvalidCheckpoint, match=BUDGET_ENV):
        check_pickle(deeper, "x")
    monkeypatch.setenv(BUDGET_ENV, "4")
    check_pickle(deeper, "x")
    monkeypatch.setenv(BUDGET_ENV, "nan")  # a typo is no verdict on the file: not an InvalidCheckpoint
    with pytest.raises(BadEnvironment, match=BUDGET_ENV):
        check_pickle(deeper, "x")


def test_a_layer_count_recorded_in_a_manifest_is_checked_against_the_step_before_use(tmp_path):
    step = _dcp_step(tmp_path / "job")
    fields = Manifest.from_json((step / MANIFEST).read_text()).model_dump(mode="json", exclude_none=True)
    fields["model"] = {"name": "debug", "overrides": {"n_layers": 2**31 - 1}}
    (step / MANIFEST).write_text(Manifest.model_validate(fields).to_json())
    out = _bounded("export", str(step), "--format", "hf", "--out", str(tmp_path / "m"))
    assert out.returncode != 0 and "n_layers=2147483647" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_an_expanded_tensor_is_refused_on_import_before_it_is_written_out(tmp_path):
    torch.save({"w": torch.ones(1).expand(600_000), "b": torch.ones(4)}, tmp_path / "w.pt")
    assert (tmp_path / "w.pt").stat().st_size < 4096
    out = _bounded("import", str(tmp_path / "w.pt"), "--to", str(tmp_path / "ckpt"))
    assert out.returncode == 2 and "expanded" in out.stderr, out.stderr
    assert not (tmp_path / "ckpt" / "step-00000000").exists()


# --- the unpickling boundary, fuzzed ------------------------------------------------------

_FUZZ_MEMORY = 64 << 20
"""Most Python memory one fuzzed file may make the check or the load allocate."""


@pytest.fixture(scope="module")
def real_metadata(tmp_path_factory) -> bytes:
    return (_dcp_step(tmp_path_factory.mktemp("fuzz")) / ".metadata").read_bytes()


def _mutate(data: bytes, draw) -> bytes:
    from hypothesis import strategies as st

    out = bytearray(data)
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "splice", "truncate"]))
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        if op == "flip" and out:
            out[at] = draw(st.integers(0, 255))
        elif op == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del out[at:at + draw(st.integers(1, 16))]
        elif op == "splice":  # a run of the file, or a shared nest, repeated elsewhere
            piece = draw(st.sampled_from([bytes(out[at:at + 64]), _shared_nest(40), b"h\xc8" * 8, b"(" * 64]))
            out[draw(st.integers(0, len(out))):0] = piece
        elif op == "truncate":
            del out[at:]
    return bytes(out)


def test_fuzzed_metadata_is_judged_in_bounded_time_and_memory(real_metadata):
    import time
    import tracemalloc

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from raytrain_ckpt.checkpoint.format.chunks import layout_problem
    from raytrain_ckpt.checkpoint.format.unpickling import check_metadata_stream

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.one_of(st.data(), st.binary(max_size=2048)))
    def judge(case) -> None:
        data = case if isinstance(case, bytes) else _mutate(real_metadata, case.draw)
        tracemalloc.reset_peak()
        t0 = time.monotonic()
        for read in (lambda: check_metadata_stream(io.BytesIO(data), "m", {"__0_0.distcp": 1 << 40}),
                     lambda: layout_problem(load_metadata(io.BytesIO(data), "m"))):
            try:
                read()
            except (InvalidCheckpoint, UnsafeCheckpoint):
                pass  # refused in one line: the verdict expected of most mutations
        assert time.monotonic() - t0 < 5.0
        assert tracemalloc.get_traced_memory()[1] < _FUZZ_MEMORY

    tracemalloc.start()
    try:
        judge()
    finally:
        tracemalloc.stop()


def test_a_passed_scan_is_remembered_by_content_and_a_refused_one_never(tmp_path, monkeypatch):
    """``ls`` / ``verify`` read the same ``.metadata`` again and again: a pickle that passed is not
    scanned again (in this process, nor in a later command), one changed byte is scanned, and a
    refused pickle is refused every time."""
    from raytrain_ckpt.checkpoint.format import prescan, scancache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(scancache, "_SEEN", set())
    data = (_dcp_step(tmp_path / "job") / ".metadata").read_bytes()
    check_pickle(data, "x")  # scanned, passed
    entries = list((tmp_path / "cache" / "raytrain_ckpt" / "scanned").rglob("*"))
    assert [p for p in entries if p.is_file()], entries

    scanned: list[int] = []
    real_run = prescan._run

    def counting_run(data, budget):
        scanned.append(len(data))
        return real_run(data, budget)

    monkeypatch.setattr(prescan, "_run", counting_run)
    monkeypatch.setattr(scancache, "_SEEN", set())  # a later command: only the directory remembers
    check_pickle(data, "x")
    assert scanned == []
    changed = bytearray(data)
    changed[len(changed) // 2] ^= 0x01
    try:
        check_pickle(bytes(changed), "x")
    except InvalidCheckpoint:
        pass
    assert scanned == [len(data)]

    nest = b"\x80\x02" + _shared_nest(40) + b"."
    for _ in range(2):
        with pytest.raises(InvalidCheckpoint):
            check_pickle(nest, "x")
    assert scanned == [len(data), len(nest), len(nest)]

    monkeypatch.setenv(scancache.CACHE_ENV, "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
    monkeypatch.setattr(scancache, "_SEEN", set())
    check_pickle(data, "y")  # scanned, and remembered in this process only
    check_pickle(data, "y")
    assert scanned == [len(data), len(nest), len(nest), len(data)]
    assert not (tmp_path / "other").exists()


def test_a_remembered_metadata_check_is_redone_when_the_files_it_was_checked_against_change(tmp_path, monkeypatch):
    """The whole ``.metadata`` check is remembered with the file sizes it was checked against: a
    shard cut short after a first ``ls`` is caught by the next one."""
    from raytrain_ckpt.checkpoint.format import scancache
    from raytrain_ckpt.checkpoint.format.unpickling import check_metadata_stream

    monkeypatch.setattr(scancache, "_SEEN", set())
    step = _dcp_step(tmp_path / "job")
    sizes = {p.name: p.stat().st_size for p in step.glob("*.distcp")}
    data = (step / ".metadata").read_bytes()
    check_metadata_stream(io.BytesIO(data), "m", sizes)
    check_metadata_stream(io.BytesIO(data), "m", sizes)  # remembered
    cut = {name: size // 2 for name, size in sizes.items()}
    with pytest.raises(InvalidCheckpoint, match="m: "):
        check_metadata_stream(io.BytesIO(data), "m", cut)
