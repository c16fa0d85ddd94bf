"""The bounded-reads property, fuzzed: any file of at most ``N`` bytes costs every reader at most
``M`` memory and ``T`` seconds.

Hostile byte strings (random, and mutations of a real ``.metadata``, a real tensor chunk and a
real manifest) go to each reader entry point: the ``.metadata`` check ``ls`` / ``verify`` use,
the safe reader's metadata load, the tensor chunk header parse and the manifest read. Each call
must return or raise one of our error types within ``T`` seconds of wall time; the reading
process's peak RSS (``ru_maxrss``) may grow by at most ``M`` over its warmed-up peak, and so may
the reader process's (``VmHWM``), whose address space the kernel caps besides. The property runs
in a fresh interpreter, so that the peaks are this run's own. N, M and T, and why, are in
docs/ARCHITECTURE.md ("Bounded reads, fuzzed").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
N_BYTES = 16 << 10
M_BYTES = 64 << 20
T_SECONDS = 15.0
LIMITS_FACTOR = "0.2"
"""``RAYTRAIN_CKPT_READ_LIMITS`` for the run: 100 MiB + 48 bytes a byte and 1 s CPU a decode, so a
file that reaches the reader's limit costs a moment; T is that decode's wall deadline (3 x CPU +
10 s) plus the reader's restart."""

_PROPERTY = r'''
import io, json, os, resource, sys, time
from pathlib import Path
sys.path.insert(0, os.environ["REPO"])
from hypothesis import HealthCheck, given, settings, strategies as st
import torch
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, UnsafeCheckpoint
from raytrain_ckpt.checkpoint.format import sandbox
from raytrain_ckpt.checkpoint.format.metadata import load_metadata
from raytrain_ckpt.checkpoint.format.tensorblob import parse_chunk
from raytrain_ckpt.checkpoint.format.unpickling import check_metadata_stream
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from tests.unit.test_bounded_reads import _dcp_step, _mutate

N, M, T = int(os.environ["N"]), int(os.environ["M"]), float(os.environ["T"])
work = Path(os.environ["WORK"])
step = _dcp_step(work / "job")
layout = CheckpointLayout(work / "job")
buf = io.BytesIO(); torch.save(torch.arange(12.0).reshape(3, 4), buf)
probe = work / "probe" / "step-00000009"; probe.mkdir(parents=True)

def read_manifest(data):
    (probe / "manifest.json").write_bytes(data)
    layout.read_manifest(probe)

READERS = {
    "metadata_check": (lambda d: check_metadata_stream(io.BytesIO(d), "m", {"__0_0.distcp": 1 << 40}),
                       (step / ".metadata").read_bytes()),
    "metadata_load": (lambda d: load_metadata(io.BytesIO(d), "m"), (step / ".metadata").read_bytes()),
    "chunk_header": (lambda d: parse_chunk(io.BytesIO(d), "c"), buf.getvalue()),
    "manifest": (read_manifest, (step / "manifest.json").read_bytes()),
}
for name, (read, seed) in READERS.items():  # warm up: imports, caches, the reader process
    assert len(seed) <= N, (name, len(seed))
    read(seed)

def reader_peak():
    proc = sandbox._READER._proc
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmHWM:"))
    except (AttributeError, OSError, StopIteration):
        return 0

base_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
base_reader = reader_peak()
seen = {"cases": 0, "slowest": 0.0, "refused": 0, "reader_peak": base_reader}

@settings(max_examples=int(os.environ["EXAMPLES"]), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(READERS)), st.one_of(st.data(), st.binary(max_size=N)))
def prop(name, case):
    read, seed = READERS[name]
    data = case if isinstance(case, bytes) else _mutate(seed, case.draw)[:N]
    t0 = time.monotonic()
    try:
        read(data)
    except (InvalidCheckpoint, UnsafeCheckpoint):
        seen["refused"] += 1
    took = time.monotonic() - t0
    seen["cases"] += 1
    seen["slowest"] = max(seen["slowest"], took)
    seen["reader_peak"] = max(seen["reader_peak"], reader_peak())
    assert took < T, (name, took, data[:64])

prop()
seen["self_growth"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - base_self
seen["reader_growth"] = seen["reader_peak"] - base_reader
print(json.dumps(seen))
'''


def test_any_small_file_costs_every_reader_bounded_memory_and_time(tmp_path):
    env = {**os.environ, "REPO": str(REPO), "PYTHONPATH": str(REPO), "WORK": str(tmp_path), "N": str(N_BYTES),
           "M": str(M_BYTES), "T": str(T_SECONDS), "EXAMPLES": "160", "RAYTRAIN_CKPT_READ_LIMITS": LIMITS_FACTOR,
           "RAYTRAIN_CKPT_SCAN_CACHE": "0"}
    proc = subprocess.run([sys.executable, "-c", _PROPERTY], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    print(seen)  # (shown with -s: the figures docs/ARCHITECTURE.md quotes)
    assert seen["cases"] >= 160 and seen["slowest"] < T_SECONDS
    assert seen["self_growth"] < M_BYTES, seen
    assert seen["reader_growth"] < M_BYTES, seen
