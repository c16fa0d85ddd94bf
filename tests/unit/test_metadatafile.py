"""``.metadata`` written from arrays (``format/metaemit.py``, ``format/metarows.py``) from the ranks'
results as numbers (``format/rankresults.py``) loads as the ``Metadata`` DCP's ``finish`` would
write, through DCP's reader and ours; a save whose byte items alone moved is spliced, byte for byte
the full build of the same results; anything else builds in full.

Plans are real DCP planner outputs (FSDP2 shards of the debug model from ``bench/scale_ranks.py``
and replicated plain state dicts deduplicated across ranks by DCP's global plan); each rank's
results cross a pickle as a writer's report does.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
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
from raytrain_ckpt.checkpoint.format.metadata import SafeFileSystemReader, load_metadata
from raytrain_ckpt.checkpoint.format.metarows import PlanArrays, from_ranks
from raytrain_ckpt.checkpoint.format.planchecks import global_plan
from raytrain_ckpt.checkpoint.format.rankresults import RankResults, sharded_names
from raytrain_ckpt.checkpoint.records import RankReport
from raytrain_ckpt.checkpoint.roles.metadatafile import MetadataFiles
from raytrain_ckpt.checkpoint.roles.repeats import plan_storage_meta
from raytrain_ckpt.control.preflight import load_spec
from raytrain_ckpt.models.config import PRESETS

META = StorageMeta(checkpoint_id=None, save_id="plan-t")
META_P = plan_storage_meta("p")


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
    each byte item ``byte_len`` long, the first item at ``base``."""
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
    return out


def _numbers(results: list[WriteResult]) -> RankResults:
    """``results`` as a writer reports them, crossed through a pickle."""
    return pickle.loads(pickle.dumps(RankResults.of(results), protocol=5))


def _reports(results: list[list[WriteResult]]) -> list[RankReport]:
    return [RankReport(1, r, 0, "p", _numbers(res)) for r, res in enumerate(results)]


def _layouts(fsdp_layouts: dict) -> list[tuple[list[SavePlan], Metadata]]:
    return [fsdp_layouts[1], fsdp_layouts[4], _replicated(1)[:2], _replicated(3)[:2]]


def _finished(metadata: Metadata, results: list[list[WriteResult]], meta: StorageMeta) -> Metadata:
    """What DCP's ``finish`` writes: the plan's ``Metadata`` with every rank's results (a later rank's
    entry for a key replacing an earlier one), the version and the storage meta."""
    storage = {wr.index: wr.storage_data for res in results for wr in res}
    return dataclasses.replace(metadata, storage_data=storage, version=CURRENT_DCP_VERSION, storage_meta=meta)


def _emit(metadata: Metadata, results: list[list[WriteResult]], meta: StorageMeta = META) -> bytes:
    return from_ranks(PlanArrays.of(metadata), [_numbers(r) for r in results], meta, CURRENT_DCP_VERSION).data


def test_a_ranks_results_as_numbers_give_back_every_key_and_storage(fsdp_layouts: dict) -> None:
    for central, _ in _layouts(fsdp_layouts):
        for c in central:
            results = _results(c, 77, 1 << 33)
            numbers = _numbers(results)
            assert [numbers.key(i) for i in range(len(results))] == [wr.index for wr in results]
            assert [numbers.key(i).index for i in range(len(results))] == [wr.index.index for wr in results]
            assert [numbers.storage(i) for i in range(len(results))] == [wr.storage_data for wr in results]
            assert numbers.digest() == RankResults.of(results).digest()
            longer = [*results[:-1], dataclasses.replace(results[-1], storage_data=dataclasses.replace(
                results[-1].storage_data, length=results[-1].storage_data.length + 1))]
            assert RankResults.of(longer).digest() != numbers.digest()
    # The chunks' names are one tuple on every rank of an FSDP2 layout: a node's batch pickles them once.
    central, _ = fsdp_layouts[4]
    ranks = [RankResults.of(_results(c, 77), sharded_names(c)) for c in central]
    assert all(r.fqns is ranks[0].fqns for r in ranks) and any(r.own for r in ranks)
    apart = sum(len(pickle.dumps(r, protocol=5)) for r in ranks)
    names = len(pickle.dumps(ranks[0].fqns, protocol=5))
    assert len(pickle.dumps(ranks, protocol=5)) < apart - 2 * names
    odd = dataclasses.replace(results[0], storage_data=dataclasses.replace(results[0].storage_data,
                                                                           transform_descriptors=["zstd"]))
    with pytest.raises(ValueError, match="transform descriptors"):
        RankResults.of([odd, *results[1:]])


@pytest.mark.parametrize("length,base", [(77, 0), (70_000, (1 << 31) - 2_000), (5, 1 << 40)])
def test_an_emitted_file_loads_as_the_metadata_dcp_would_write(fsdp_layouts: dict, length: int, base: int) -> None:
    for central, metadata in _layouts(fsdp_layouts):
        results = [_results(c, length, base) for c in central]
        want = _finished(metadata, results, META)
        file = from_ranks(PlanArrays.of(metadata), [_numbers(r) for r in results], META, CURRENT_DCP_VERSION)
        data = file.data
        assert file.size == len(data)
        streamed = io.BytesIO()
        file.write_to(streamed)
        assert streamed.getvalue() == data
        got = pickle.loads(data)
        assert isinstance(got, Metadata) and got == want
        assert got.storage_data == want.storage_data   # (a dict's order means nothing to a reader)
        assert {k: k.index for k in got.storage_data} == {k: k.index for k in want.storage_data}
        assert load_metadata(io.BytesIO(data), ".metadata") == want   # the pre-scan and the restricted unpickler


def test_a_key_two_ranks_wrote_keeps_the_later_ranks_entry_as_dcp_does(fsdp_layouts: dict) -> None:
    central, metadata = fsdp_layouts[4]
    results = [_results(c, 77) for c in central]
    twice = results[0][0]
    results[2] = [*results[2], WriteResult(twice.index, twice.size_in_bytes, _StorageInfo("other", 5, 6))]
    got = pickle.loads(_emit(metadata, results))
    assert got == _finished(metadata, results, META) and got.storage_data[twice.index] == _StorageInfo("other", 5, 6)


# Byte lengths and first offsets: small to large ints and back (every int of the file is eight bytes wide).
LENGTHS = [(70, 71, 0), (200, 300, 0), (65_000, 70_000, 0), (90, 91, (1 << 31) - 2_000), (300, 20, 60_000)]


@pytest.mark.parametrize("before,after,base", LENGTHS)
def test_a_spliced_file_is_byte_equal_to_a_full_build(fsdp_layouts: dict, before: int, after: int, base: int) -> None:
    for central, metadata in _layouts(fsdp_layouts):
        files = MetadataFiles()
        old = [_results(c, before, base) for c in central]
        first = files.make("p", metadata, _reports(old)).data
        new = [_results(c, after, base) for c in central]
        spliced = files.make("p", metadata, _reports(new)).data
        assert (files.built, files.spliced) == (1, 1)
        assert spliced == _emit(metadata, new, META_P) != first
        assert pickle.loads(spliced) == _finished(metadata, new, META_P)
        assert files.make("p", metadata, _reports(old)).data == first   # and back
        assert (files.built, files.spliced) == (1, 2)


def test_metadata_files_build_in_full_when_more_than_byte_items_moved(fsdp_layouts: dict) -> None:
    central, metadata = fsdp_layouts[4]
    files = MetadataFiles()
    base = [_results(c, 70) for c in central]
    files.make("p", metadata, _reports(base))
    # The byte items of ranks 0 and 2 a byte longer (DCP's dedup spreads them), the others' as they were: spliced.
    new = [_results(c, 71) if r in (0, 2) else base[r] for r, c in enumerate(central)]
    assert files.make("p", metadata, _reports(new)).data == _emit(metadata, new, META_P)
    assert (files.built, files.spliced) == (1, 1)
    # A moved tensor chunk: built in full.
    moved = [list(res) for res in new]
    at = next(i for i, w in enumerate(moved[2]) if w.index.offset is not None and i > 0)
    wr = moved[2][at]
    info = wr.storage_data
    moved[2][at] = WriteResult(wr.index, wr.size_in_bytes, _StorageInfo(info.relative_path, info.offset + 1, info.length))
    assert files.make("p", metadata, _reports(moved)).data == _emit(metadata, moved, META_P)
    assert (files.built, files.spliced) == (2, 1)
    # A byte item written to another file: built in full.
    other = [list(res) for res in new]
    wr = next(w for w in other[0] if w.index.offset is None)
    other[0][other[0].index(wr)] = WriteResult(wr.index, wr.size_in_bytes, _StorageInfo(
        "elsewhere.distcp", wr.storage_data.offset, wr.storage_data.length))
    files.make("p", metadata, _reports(new))
    assert files.make("p", metadata, _reports(other)).data == _emit(metadata, other, META_P)
    assert (files.built, files.spliced) == (4, 1)
    # A writer that lays byte items first: a longer byte item moves its file's tensors, built in full.
    files.make("p", metadata, _reports([_results(c, 70, bytes_first=True) for c in central]))
    longer = [_results(c, 71, bytes_first=True) for c in central]
    assert files.make("p", metadata, _reports(longer)).data == _emit(metadata, longer, META_P)
    assert (files.built, files.spliced) == (6, 1)
    # A rank fewer, or another plan: built in full.
    files.make("p", metadata, _reports(base)[:3])
    other_central, other_md = fsdp_layouts[1]
    files.make("q", other_md, [dataclasses.replace(r, plan_id="q") for r in _reports([_results(c, 70) for c in other_central])])
    assert (files.built, files.spliced) == (8, 1)


def test_a_splice_of_a_key_that_is_no_byte_item_writes_nothing(fsdp_layouts: dict) -> None:
    central, metadata = fsdp_layouts[4]
    results = [_results(c, 77) for c in central]
    file = from_ranks(PlanArrays.of(metadata), [_numbers(r) for r in results], META, CURRENT_DCP_VERSION)
    before = file.data
    tensor_key = next(wr.index for res in results for wr in res if wr.index not in file.byte_at)
    some_byte_key = next(iter(file.byte_at))
    assert file.moved({some_byte_key: (1, 2), tensor_key: (3, 4)}) is None
    assert file.moved({some_byte_key: (1, 2)}).data != before
    assert file.data == before   # a splice makes a new file: the last one is unchanged


def _write_step(directory: Path, central: list[SavePlan], planners: list[DefaultSavePlanner]) -> list[list[WriteResult]]:
    """Each rank's file written by the writer every save uses (``write_rank_files``: byte items
    after the tensors)."""
    directory.mkdir()
    return [write_rank_files(directory, planner.finish_plan(plan), planner.resolve_data).results
            for plan, planner in zip(central, planners)]


def test_a_spliced_save_loads_through_dcp(tmp_path: Path) -> None:
    # Two saves of a layout whose loader position grew 296 bytes: the real writer lays it after
    # the tensors, so no tensor moves and the second .metadata is spliced from the first.
    files = MetadataFiles()
    for step, loader in ((10, "9" * 4), (20, "9" * 300)):
        central, metadata, planners = _replicated(3, loader)
        step_dir = tmp_path / f"step-{step}"
        results = _write_step(step_dir, central, planners)
        (step_dir / ".metadata").write_bytes(files.make("p", metadata, _reports(results)).data)
    assert (files.built, files.spliced) == (1, 1)
    assert (step_dir / ".metadata").read_bytes() == _emit(metadata, results, META_P)
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


def test_a_save_whose_byte_items_grew_sends_only_the_rows_that_differ(fsdp_layouts: dict) -> None:
    from raytrain_ckpt.checkpoint.format.rankresults import ResultsDelta
    from raytrain_ckpt.checkpoint.roles.repeats import ResultsCache, SentResults

    central, metadata = fsdp_layouts[4]
    sent, cache, files = SentResults(), ResultsCache(), MetadataFiles()

    def save(step: int, results: list[list[WriteResult]], coordinator: ResultsCache) -> list[tuple[RankReport, RankReport, int]]:
        out = []
        for r, res in enumerate(results):
            slim = sent.slim(RankReport(step, r, 0, "p", RankResults.of(res, sharded_names(central[r]))))
            wire = pickle.dumps(slim, protocol=5)
            got = coordinator.resolve(pickle.loads(wire))
            if got is None:   # RESEND: the writer sends its results in full
                slim = dataclasses.replace(slim, results=RankResults.of(res, sharded_names(central[r])))
                got = coordinator.resolve(pickle.loads(pickle.dumps(slim, protocol=5)))
            sent.delivered(slim)
            out.append((slim, got, len(wire)))
        return out

    first = save(1, [_results(c, 70) for c in central], cache)
    assert all(isinstance(s.results, RankResults) for s, _, _ in first)
    files.make("p", metadata, [got for _, got, _ in first])
    grown = [_results(c, 71) for c in central]
    second = save(2, grown, cache)
    for r, ((slim, got, wire), (_, _, full)) in enumerate(zip(second, first)):
        own = sum(1 for wr in grown[r] if wr.index.offset is None)
        assert isinstance(slim.results, ResultsDelta) and len(slim.results.rows) == own   # the byte items alone
        assert wire * 5 < full
        assert got.results.storage_dict() == RankResults.of(grown[r]).storage_dict()
        assert got.digest == RankResults.of(grown[r], sharded_names(central[r])).digest()
    assert files.make("p", metadata, [got for _, got, _ in second]).data == _emit(metadata, grown, META_P)
    assert (files.built, files.spliced) == (1, 1)
    # The same results again: digests alone.
    assert all(s.results is None for s, _, _ in save(3, grown, cache))
    # A coordinator that no longer holds the base (it restarted): the delta is refused, the
    # results go again in full, and the save is whole.
    fresh = ResultsCache()
    again = save(4, [_results(c, 72) for c in central], fresh)
    assert all(isinstance(s.results, RankResults) for s, _, _ in again)
    assert all(got.results.storage_dict() == RankResults.of(_results(c, 72)).storage_dict()
               for (_, got, _), c in zip(again, central))
