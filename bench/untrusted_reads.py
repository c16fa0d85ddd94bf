"""What the bounded reads of untrusted checkpoints cost: the reader process under the kernel's
limits (with the pickle pre-scan and the chunk-layout check it runs), the chunk headers parsed.

Two measurements, each as a ratio of the same work without the added checks (the baseline is
this tree with the ``.metadata`` check replaced by a plain unpickle in this process: no reader
process, no pre-scan, no layout or chunk-header check):

1. ``ls`` and ``verify`` (as fresh ``python -m raytrain_ckpt`` processes) of a root holding
   1,000 steps (copies of one real DCP step of a small model, each with its own manifest).
2. The pre-scan and the layout check on a realistic ``.metadata`` of the 8B preset saved by 8
   ranks: the model's 291 tensors (and, second, with AdamW's two moments: 873) each in 8 chunks,
   synthesized from DCP's own metadata classes (shapes from the model on the meta device; no
   tensor bytes). Timed: the torch-free check ``ls``/``verify`` run (the first file of its shape
   the reader sees, and the next save's file right after it: its pre-scan carried over,
   ``scandiff.py``), and loading's unpickle.

Usage::

    .venv/bin/python bench/untrusted_reads.py [--steps 1000] [--reps 3]
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_RUN = """
import sys
if sys.argv[1] == "off":
    import raytrain_ckpt.checkpoint.format.unpickling as u
    import raytrain_ckpt.checkpoint.format.verify as v
    u.check_metadata_stream = v.check_metadata_stream = lambda f, name, files=None, chunks=False: (
        u.unpickle(u._CheckingUnpickler(u.io.BytesIO(f.read())), name), None)[1]

    class PlainChecks:  # the batched form ``ls`` / ``status`` use, as the same plain unpickle
        def __init__(self, items, chunks=False):
            self.items = items

        def results(self):
            return [(u.unpickle(u._CheckingUnpickler(u.io.BytesIO(d)), n), None)[1] for d, n, _ in self.items]

    v.MetadataChecks = PlainChecks
    import raytrain_ckpt.checkpoint.format.scancache as c
    c.passed_before = lambda key: False
    c.remember_pass = lambda key: None
from raytrain_ckpt.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def _root(work: Path, steps: int) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest, describe_file
    from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

    root = work / "job"
    layout = CheckpointLayout(root)
    tmp = layout.new_tmp_dir(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optim.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=str(tmp), no_dist=True)
    files = {p.name: describe_file(p) for p in sorted(tmp.iterdir())}
    first = layout.commit(tmp, Manifest(step=1, world_size=1, dp_size=1, spec_hash="h", files=files))
    text = (first / MANIFEST).read_text()
    metadata = pickle.loads((first / ".metadata").read_bytes())  # this bench's own file
    for step in range(2, steps + 1):
        d = layout.step_dir(step)
        shutil.copytree(first, d)
        # Each step's .metadata differs, as a real run's do (DCP records a save id per save): the
        # pre-scan's cache of verdicts by content (scancache.py) gets nothing for free here.
        metadata.storage_meta = StorageMeta(checkpoint_id=str(d), save_id=f"save-{step}")
        (d / ".metadata").write_bytes(pickle.dumps(metadata))
        fields = Manifest.from_json(text).model_dump(mode="json", exclude_none=True)
        files = {p.name: describe_file(p) for p in sorted(d.iterdir()) if p.name != MANIFEST}
        (d / MANIFEST).write_text(Manifest.model_validate({**fields, "step": step, "files": files}).to_json())
    return root


def _cli(mode: str, args: list[str], reps: int, cache: Path) -> float:
    """Median seconds of the command. ``mode``: ``off`` (no added checks), ``cold`` (checks, an empty
    cache of scan verdicts each time), ``warm`` (checks, the verdicts of an earlier command kept)."""
    times = []
    for rep in range(reps + (mode == "warm")):
        where = cache / (mode if mode == "warm" else f"{mode}-{rep}")
        env = dict(os.environ, XDG_CACHE_HOME=str(where))
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _RUN, mode, *args], cwd=REPO, capture_output=True, text=True,
                             env=env)
        if mode != "warm" or rep > 0:  # warm: the first run fills the cache
            times.append(time.perf_counter() - t0)
        assert out.returncode == 0, out.stderr[-2000:]
    return statistics.median(times)


def _metadata_8b(ranks: int, with_optim: bool) -> bytes:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    from raytrain_ckpt.models import describe_model
    from raytrain_ckpt.models.hf import hf_adapter

    shapes = hf_adapter(describe_model("8b", {})).parameter_shapes()
    names = {f"model.{n}": shape for n, shape in shapes.items()}
    if with_optim:
        for moment in ("exp_avg", "exp_avg_sq"):
            names.update({f"optim.state.{n}.{moment}": shape for n, shape in shapes.items()})
    entries, storage = {}, {}
    offset = [0] * ranks
    for fqn, shape in names.items():
        rows = shape[0]
        chunks = []
        for r in range(ranks):
            lo, hi = rows * r // ranks, rows * (r + 1) // ranks
            sizes = torch.Size([hi - lo, *shape[1:]])
            offs = torch.Size([lo] + [0] * (len(shape) - 1))
            chunks.append(ChunkStorageMetadata(offsets=offs, sizes=sizes))
            length = sizes.numel() * 2 + 1024  # torch.save's zip records around the bytes
            storage[MetadataIndex(fqn, offs, r)] = _StorageInfo(f"__{r}_0.distcp", offset[r], length)
            offset[r] += length
        entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size(shape), chunks)
    return pickle.dumps(Metadata(state_dict_metadata=entries, storage_data=storage,
                                 storage_meta=StorageMeta(checkpoint_id="/ckpt/job/step-00000990", save_id="save-990")))


def _best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _other_pickles() -> None:
    """Two small ``.metadata`` of other shapes through the reader: it then holds no scan of the next file."""
    from raytrain_ckpt.checkpoint.format import unpickling
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    for n in (1, 2):
        other = pickle.dumps(Metadata(state_dict_metadata={f"x{i}": BytesStorageMetadata() for i in range(n)}))
        unpickling.check_metadata_stream(io.BytesIO(other), "other")


def _best_first(fn, reps: int) -> float:
    """``_best`` of ``fn`` with the reader's kept scans pushed out before each run."""
    times = []
    for _ in range(reps):
        _other_pickles()
        times.append(_best(fn, 1))
    return min(times)


def _best_of_next(data: bytes, fn, reps: int) -> float:
    """``_best`` of ``fn`` right after the reader checked ``data`` (a job's previous save)."""
    from raytrain_ckpt.checkpoint.format import unpickling

    times = []
    for _ in range(reps):
        _other_pickles()
        unpickling.check_metadata_stream(io.BytesIO(data), "m")
        times.append(_best(fn, 1))
    return min(times)


def _next_save(md) -> bytes:
    """``md``'s pickle as the job's next save writes it: a new save id and path, items moved."""
    import copy

    from torch.distributed.checkpoint.metadata import StorageMeta

    md = copy.deepcopy(md)
    md.storage_meta = StorageMeta(checkpoint_id="/ckpt/job/step-00001000", save_id="save-1000")
    for info in list(md.storage_data.values())[:50]:
        info.offset += 1_000_003
    return pickle.dumps(md)


def _metadata_bench(reps: int) -> None:
    from raytrain_ckpt.checkpoint.format import metadata as md_mod
    from raytrain_ckpt.checkpoint.format import unpickling
    from raytrain_ckpt.checkpoint.format.chunks import layout_problem
    from raytrain_ckpt.checkpoint.format.prescan import check_pickle

    from raytrain_ckpt.checkpoint.format import scancache

    remembered = scancache.passed_before
    scancache.passed_before = lambda key: False  # every figure below is a first read: scanned each time
    os.environ[scancache.CACHE_ENV] = "0"
    for with_optim in (False, True):
        data = _metadata_8b(8, with_optim)
        loaded = md_mod.load_metadata(io.BytesIO(data), "m")
        sizes = {f"__{r}_0.distcp": 1 << 50 for r in range(8)}
        n = len(loaded.state_dict_metadata)
        prescan = _best(lambda: check_pickle(data, "m"), reps)
        layout = _best(lambda: layout_problem(loaded, sizes), reps)
        # the reader process keeps the pickles it scanned last (scandiff.py): two others go first,
        # so that each timed check is the first of its file
        check_on = _best_first(lambda: unpickling.check_metadata_stream(io.BytesIO(data), "m", sizes), reps)
        load_on = _best_first(lambda: md_mod.load_metadata(io.BytesIO(data), "m"), reps)
        nxt = _next_save(loaded)
        check_next = _best_of_next(data, lambda: unpickling.check_metadata_stream(io.BytesIO(nxt), "m", sizes), reps)
        saved = unpickling.sandbox.decode_in_sandbox
        # the baseline: a plain unpickle in this process (no reader process, pre-scan or layout check)
        unpickling.sandbox.decode_in_sandbox = lambda kind, blob, where, args=None, limits=None: (
            unpickling.unpickle(unpickling._CheckingUnpickler(io.BytesIO(blob)), where), None)[1]
        try:
            check_off = _best(lambda: unpickling.check_metadata_stream(io.BytesIO(data), "m", sizes), reps)
            load_off = _best(lambda: md_mod.load_metadata(io.BytesIO(data), "m"), reps)
        finally:
            unpickling.sandbox.decode_in_sandbox = saved
        scancache.passed_before = remembered
        unpickling.check_metadata_stream(io.BytesIO(data), "m", sizes)
        warm = _best(lambda: unpickling.check_metadata_stream(io.BytesIO(data), "m", sizes), reps)
        scancache.passed_before = lambda key: False
        print(f"8B preset, 8 ranks, {n} tensors x 8 chunks, .metadata {len(data) / 1e6:.2f} MB:")
        print(f"  pre-scan {prescan * 1e3:.1f} ms, layout check {layout * 1e3:.1f} ms")
        print(f"  torch-free check (ls/verify): {check_off * 1e3:.1f} ms -> {check_on * 1e3:.1f} ms "
              f"(+{(check_on / check_off - 1) * 100:.0f}%); read again (its scan remembered): {warm * 1e3:.1f} ms "
              f"(+{(warm / check_off - 1) * 100:.0f}%)")
        print(f"  the next save's .metadata (its save id and path, 50 chunks' offsets changed), checked after "
              f"this one: {check_next * 1e3:.1f} ms (+{(check_next / check_off - 1) * 100:.0f}%; "
              "its pre-scan carried over)")
        print(f"  loading's unpickle: {load_off * 1e3:.1f} ms -> {load_on * 1e3:.1f} ms "
              f"(+{(load_on / load_off - 1) * 100:.0f}%; the layout check runs in the reader, "
              f"+{layout / load_off * 100:.0f}% more)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)
    sys.path.insert(0, str(REPO))
    work = Path(tempfile.mkdtemp(prefix="untrusted-reads-"))
    try:
        t0 = time.perf_counter()
        root = _root(work, args.steps)
        print(f"root of {args.steps} steps built in {time.perf_counter() - t0:.1f}s")
        for name, cli in (("ls", ["ls", str(root)]), ("ls --checksum", ["ls", "--checksum", str(root)]),
                          ("verify of one step", ["verify", str(root / "step-00000001")])):
            cache = work / "cache" / name.replace(" ", "_")  # each command starts with no verdicts kept
            off, cold, warm = (_cli(mode, cli, args.reps, cache) for mode in ("off", "cold", "warm"))
            print(f"{name} of a root of {args.steps} steps: {off:.2f}s -> first read {cold:.2f}s "
                  f"({(cold / off - 1) * 100:+.1f}%), read again {warm:.2f}s ({(warm / off - 1) * 100:+.1f}%)")
        _metadata_bench(args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
