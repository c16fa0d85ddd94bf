"""A ``.metadata`` spliced from the last one when only byte items moved is byte for byte the full
build of the same results; anything else builds in full; the file loads as DCP's loader reads it.

Plans are real DCP planner outputs (FSDP2 shards of the debug model from ``bench/scale_ranks.py``
and replicated plain state dicts deduplicated across ranks by DCP's global plan); each rank's
results cross a pickle as a writer's report does.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.storage import WriteResult

from bench.scale_ranks import local_plan, template
from raytrain_ckpt.checkpoint.datapath.localfile import write_rank_files
from raytrain_ckpt.checkpoint.format.metadata import SafeFileSystemReader
from raytrain_ckpt.checkpoint.format.metapickle import _ints, build, splice
from raytrain_ckpt.checkpoint.format.planchecks import global_plan
from raytrain_ckpt.checkpoint.records import RankReport
from raytrain_ckpt.checkpoint.roles.metadatafile import MetadataFiles
from raytrain_ckpt.checkpoint.roles import metadatafile
from raytrain_ckpt.checkpoint.roles.repeats import SentResults, byte_keys, results_digest
from raytrain_ckpt.control.preflight import load_spec
from raytrain_ckpt.models.config import PRESETS

META = StorageMeta(checkpoint_id=None, save_id="plan-t")


def _replicated_state(loader: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "loader": {"position": loader, "epoch": 3},
            "rng": {"seed": [7] * 5}}


def _replicated(world: int, loader: str = "9" * 4) -> tuple[list[SavePlan], Metadata, list[DefaultSavePlanner]]:
    """DCP's plans of ``world`` ranks holding the same plain state dict (DCP's dedup spreads the items)."""
    planners, local = [], []
    for rank in range(world):
        planner = DefaultSavePlanner()
        planner.set_up_planner(_replicated_state(loader), is_coordinator=rank == 0)
        planners.append(planner)
        local.append(planner.create_local_plan())
    return _global(local) + (planners,)


def _global(local: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    central, metadata = global_plan(local)
    return FileSystemWriter("/unused").prepare_global_plan(central), metadata


@pytest.fixture(scope="module")
def fsdp_layouts() -> dict[int, tuple[list[SavePlan], Metadata]]:
    shape = template(load_spec("jobs/llama_debug_fsdp.yaml", []), PRESETS["debug"])
    return {n: _global([local_plan(shape, r, n) for r in range(n)]) for n in (1, 4)}


def _results(central: SavePlan, byte_len: int, base: int = 0, bytes_first: bool = False) -> list[WriteResult]:
    """A writer's results for ``central``: one file, tensors then byte items (or byte items first),
    each byte item ``byte_len`` long, the first item at ``base``; crossed through a pickle."""
    name = f"{central.storage_data.prefix}0.distcp"
    tensors = [i for i in central.items if i.type != WriteItemType.BYTE_IO]
    byte_items = [i for i in central.items if i.type == WriteItemType.BYTE_IO]
    out, offset = [], base
    for item in (byte_items + tensors if bytes_first else tensors + byte_items):
        if item.type == WriteItemType.BYTE_IO:
            length = byte_len
        else:
            data = item.tensor_data
            length = 900 + data.properties.dtype.itemsize * int(torch.Size(data.chunk.sizes).numel())
        out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)))
        offset += length
    return pickle.loads(pickle.dumps(out, protocol=5))


def _reports(central: list[SavePlan], results: list[list[WriteResult]]) -> list[RankReport]:
    return [RankReport(1, r, 0, "p", res, digest=results_digest(res)) for r, res in enumerate(results)]


def _layouts(fsdp_layouts: dict) -> list[tuple[list[SavePlan], Metadata]]:
    return [fsdp_layouts[1], fsdp_layouts[4], _replicated(1)[:2], _replicated(3)[:2]]


# Byte lengths and first offsets whose int opcodes change size when spliced: BININT1 -> BININT2 ->
# BININT -> LONG1 and back.
LENGTHS = [(70, 71, 0), (200, 300, 0), (65_000, 70_000, 0), (90, 91, (1 << 31) - 2_000), (300, 20, 60_000)]


@pytest.mark.parametrize("before,after,base", LENGTHS)
def test_a_spliced_file_is_byte_equal_to_a_full_build(fsdp_layouts: dict, before: int, after: int, base: int) -> None:
    for central, metadata in _layouts(fsdp_layouts):
        old = [_results(c, before, base) for c in central]
        new = [_results(c, after, base) for c in central]
        first = build(metadata, old, CURRENT_DCP_VERSION, META)
        assert first.entries, "every layout has byte items"
        changed = {wr.index: wr.storage_data for res in new for wr in res if wr.index in first.entries}
        spliced = splice(first, changed)
        full = build(metadata, new, CURRENT_DCP_VERSION, META)
        assert spliced is not None and spliced.data == full.data
        assert spliced.data != first.data
        # The entries the splice keeps are where a full build puts them: a second splice is exact too.
        back = {k: v for res in old for wr in res for k, v in [(wr.index, wr.storage_data)] if k in first.entries}
        again = splice(spliced, back)
        assert again is not None and again.data == first.data


def test_the_walk_of_a_byte_items_value_finds_the_ints_pickletools_finds(fsdp_layouts: dict) -> None:
    # The splice finds a value's offset and length by its own walk of the opcodes: at every int
    # opcode size, on every layout, the same positions and values as pickletools' full walk.
    int_ops = {"BININT", "BININT1", "BININT2", "LONG1"}
    walked = 0
    for _, length, base in LENGTHS:
        for central, metadata in _layouts(fsdp_layouts):
            file = build(metadata, [_results(c, length, base) for c in central], CURRENT_DCP_VERSION, META)
            for entry in file.entries.values():
                want = [(pos, arg) for op, arg, pos in pickletools.genops(entry.code + b".") if op.name in int_ops]
                assert _ints(entry.code) == want == [(want[0][0], entry.info.offset), (want[1][0], entry.info.length)]
                walked += 1
    assert walked > 100
    # an opcode it does not know, or a length running past the end: no positions (built in full)
    assert _ints(b"h\x00I12\n") is None and _ints(b"X\xff\x00\x00\x00ab") is None and _ints(b"c\nmod") is None
    assert _ints(b"J\xff\xff\xff\xff\x8a\x05\x14\x1a\x99\xbe\x1c") == [(0, -1), (5, 123456789012)]


def test_a_full_build_loads_as_the_metadata_dcp_would_write(fsdp_layouts: dict) -> None:
    for central, metadata in _layouts(fsdp_layouts):
        results = [_results(c, 77) for c in central]
        ours = pickle.loads(build(metadata, results, CURRENT_DCP_VERSION, META).data)
        storage = {wr.index: wr.storage_data for res in results for wr in res}
        assert isinstance(ours, Metadata)
        assert ours.state_dict_metadata == metadata.state_dict_metadata
        assert ours.planner_data == metadata.planner_data
        assert ours.storage_data == storage and set(ours.storage_data) == set(storage)
        assert (ours.version, ours.storage_meta) == (CURRENT_DCP_VERSION, META)


def test_metadata_files_splice_only_when_byte_items_alone_moved(fsdp_layouts: dict) -> None:
    central, metadata = fsdp_layouts[4]
    files = MetadataFiles()
    base = [_results(c, 70) for c in central]
    first = files.make("p", metadata, _reports(central, base))
    # The byte items of ranks 0 and 2 a byte longer (DCP's dedup spreads them over the ranks), the
    # others' results as they were: spliced.
    new = [_results(c, 71) if r in (0, 2) else base[r] for r, c in enumerate(central)]
    spliced = files.make("p", metadata, _reports(central, new))
    assert (files.built, files.spliced) == (1, 1)
    assert spliced == build(metadata, new, CURRENT_DCP_VERSION, META_P).data != first
    # A moved tensor chunk: built in full.
    moved = [list(res) for res in new]
    wr = next(w for w in moved[2] if w.index not in {k for k in build(metadata, new, None, None).entries})
    info = wr.storage_data
    moved[2][moved[2].index(wr)] = WriteResult(wr.index, wr.size_in_bytes,
                                               _StorageInfo(info.relative_path, info.offset + 1, info.length))
    assert files.make("p", metadata, _reports(central, moved)) == build(metadata, moved, CURRENT_DCP_VERSION,
                                                                         META_P).data
    assert (files.built, files.spliced) == (2, 1)
    # A writer that lays byte items first: a longer byte item moves its file's tensors, built in full.
    first_bytes = [_results(c, 70, bytes_first=True) for c in central]
    files.make("p", metadata, _reports(central, first_bytes))
    longer = [_results(c, 71, bytes_first=True) for c in central]
    assert files.make("p", metadata, _reports(central, longer)) == build(metadata, longer, CURRENT_DCP_VERSION,
                                                                          META_P).data
    assert (files.built, files.spliced) == (4, 1)
    # A new shape (another layout's plan): built in full.
    other, other_md = fsdp_layouts[1]
    files.make("q", other_md, _reports(other, [_results(c, 70) for c in other]))
    assert (files.built, files.spliced) == (5, 1)


META_P = StorageMeta(checkpoint_id=None, save_id="plan-p")


def _sent(central: list[SavePlan], results: list[list[WriteResult]]) -> list[RankReport]:
    """Reports as the writers send them: each with its byte items' positions and the digest of
    its tensor results (``SentResults.slim`` given the plan's byte items)."""
    return [SentResults().slim(RankReport(1, r, 0, "p", res), byte_keys(c))
            for r, (c, res) in enumerate(zip(central, results))]


def test_a_splice_takes_the_writers_digest_of_its_tensor_results(fsdp_layouts: dict, monkeypatch) -> None:
    # The coordinator compares the digest each writer sent: it pickles no rank's results itself.
    central, metadata = fsdp_layouts[4]
    files = MetadataFiles()
    base = [_results(c, 70) for c in central]
    files.make("p", metadata, _sent(central, base))
    computed = []
    real = metadatafile.tensor_digest
    monkeypatch.setattr(metadatafile, "tensor_digest", lambda *a: computed.append(a) or real(*a))
    new = [_results(c, 71) for c in central]
    assert files.make("p", metadata, _sent(central, new)) == build(metadata, new, CURRENT_DCP_VERSION, META_P).data
    assert (files.built, files.spliced, computed) == (1, 1, [])
    # A tensor that moved where the cheap test does not look (not right after a byte item): only
    # the writer's digest tells, and the file is built in full.
    moved = [list(res) for res in new]
    at = next(i for i, w in enumerate(moved[1]) if w.index not in files._last.file.entries
              and i + 1 < len(moved[1]) and moved[1][i + 1].index not in files._last.file.entries and i > 0
              and moved[1][i - 1].index not in files._last.file.entries)
    wr = moved[1][at]
    moved[1][at] = WriteResult(wr.index, wr.size_in_bytes, _StorageInfo(wr.storage_data.relative_path,
                                                                         wr.storage_data.offset, wr.storage_data.length + 1))
    assert files.make("p", metadata, _sent(central, moved)) == build(metadata, moved, CURRENT_DCP_VERSION, META_P).data
    assert (files.built, files.spliced, computed) == (2, 1, [])
    # A report whose byte items lie elsewhere than the coordinator recorded: built in full.
    again = [_results(c, 72) for c in central]
    reports = _sent(central, again)
    reports[3] = replace(reports[3], byte_at=reports[3].byte_at[1:])
    assert files.make("p", metadata, reports) == build(metadata, again, CURRENT_DCP_VERSION, META_P).data
    assert (files.built, files.spliced, len(computed)) == (3, 1, 1)  # its digest made here
    # Reports without the writer's digest (none of ours): each changed rank's is computed here,
    # the same digest the writers send, and the file is spliced.
    for results in (new, again):
        assert files.make("p", metadata, _reports(central, results)) == build(metadata, results,
                                                                                CURRENT_DCP_VERSION, META_P).data
    assert (files.built, files.spliced, len(computed)) == (3, 3, 9)


def _write_step(directory: Path, central: list[SavePlan],
                planners: list[DefaultSavePlanner]) -> list[list[WriteResult]]:
    """Each rank's file written by the writer every save uses (``write_rank_files``: byte items
    after the tensors), its results crossed through a pickle as a writer's report is."""
    directory.mkdir()
    results = []
    for plan, planner in zip(central, planners):
        written = write_rank_files(directory, planner.finish_plan(plan), planner.resolve_data)
        results.append(pickle.loads(pickle.dumps(written.results, protocol=5)))
    return results


def test_a_spliced_save_loads_through_dcp(tmp_path: Path) -> None:
    # Two saves of a layout whose loader position grew 296 bytes: the real writer lays it after
    # the tensors, so no tensor moves and the second .metadata is spliced from the first.
    files = MetadataFiles()
    for step, loader in ((10, "9" * 4), (20, "9" * 300)):
        central, metadata, planners = _replicated(3, loader)
        step_dir = tmp_path / f"step-{step}"
        results = _write_step(step_dir, central, planners)
        (step_dir / ".metadata").write_bytes(files.make("p", metadata, _reports(central, results)))
    assert (files.built, files.spliced) == (1, 1)
    assert (step_dir / ".metadata").read_bytes() == build(metadata, results, CURRENT_DCP_VERSION, META_P).data
    read = FileSystemReader(str(step_dir)).read_metadata()
    assert read.storage_data == {wr.index: wr.storage_data for res in results for wr in res}
    assert isinstance(read.state_dict_metadata["loader.position"], BytesStorageMetadata)
    assert SafeFileSystemReader(str(step_dir)).read_metadata().storage_data == read.storage_data
    want = _replicated_state("9" * 300)
    got = _replicated_state("")
    got["model"] = {k: torch.zeros_like(v) for k, v in got["model"].items()}
    load(got, storage_reader=FileSystemReader(str(step_dir)), planner=DefaultLoadPlanner(), no_dist=True)
    assert got["loader"]["position"] == "9" * 300 and got["rng"]["seed"] == [7] * 5
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
