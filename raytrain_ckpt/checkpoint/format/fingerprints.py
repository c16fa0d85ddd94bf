"""Per-tensor fingerprints of a committed step, and the difference of two steps.

A fingerprint says what a tensor holds without its bytes: element count, sum, L2 norm, the count
of NaN and infinite elements and the CRC-32C of its bytes (two tensors with the same CRC and shape
are the same, for any practical purpose). Read one tensor at a time from the step's DCP files with
no process group (``dcp.load(no_dist=True)`` through the safe reader), so a step of any size is
read in the memory of its largest tensor, off the training path (``raytrain-ckpt stats/diff/bisect``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raytrain_ckpt.checkpoint.format.metadata import SafeLoadPlanner, safe_reader
from raytrain_ckpt.checkpoint.format.tensorsums import ShardSums, tensor_sums

__all__ = ["ShardSums", "TensorDiff", "TensorStats", "diff_step_dirs", "diff_steps", "merge_shard_sums", "shard_sums", "step_stats",
           "step_tensors", "tensor_stats"]


@dataclass(frozen=True)
class TensorStats:
    """One tensor's fingerprint."""

    numel: int
    sum: float
    norm: float
    nan: int
    inf: int
    crc32c: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = list(self.shape)
        for key in ("sum", "norm"):  # JSON has no NaN: a non-finite value is a string
            if not math.isfinite(out[key]):
                out[key] = str(out[key])
        return out


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor differs between two steps (``None`` on a side: absent there)."""

    name: str
    a: TensorStats | None
    b: TensorStats | None
    delta_norm: float | None = None
    """``norm(b - a)`` in float64, the size of the change (not the change of the norm): None when
    a side is missing, the shapes differ, or only fingerprints were compared (``diff_steps``)."""


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """The fingerprint of ``t`` (float sums in float64; integer tensors as they are)."""
    flat = t.detach().reshape(-1)
    wide = flat.to(torch.float64)
    nan = int(torch.isnan(wide).sum()) if flat.is_floating_point() else 0
    inf = int(torch.isinf(wide).sum()) if flat.is_floating_point() else 0
    raw = flat.contiguous().view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return TensorStats(int(flat.numel()), float(wide.sum()), float(torch.linalg.vector_norm(wide)), nan, inf,
                       _crc32c.crc32c(raw), tuple(t.shape), str(t.dtype).removeprefix("torch."))


def _tensor_keys(path: Path | str) -> dict[str, TensorStorageMetadata]:
    meta = safe_reader(path).read_metadata()
    return {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def step_tensors(path: Path | str, only: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the step at ``path`` (or just ``only``), full, one at a time, sorted by name."""
    keys = _tensor_keys(path)
    if only is not None:
        if only not in keys:
            raise KeyError(only)
        keys = {only: keys[only]}
    for name in sorted(keys):
        md = keys[name]
        out = torch.empty(md.size, dtype=md.properties.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that no process group is used: intended here
            dcp.load({name: out}, storage_reader=safe_reader(path), planner=SafeLoadPlanner(), no_dist=True)
        yield name, out


def step_stats(path: Path | str, only: str | None = None) -> dict[str, TensorStats]:
    """The fingerprint of every tensor of the step at ``path`` (or of ``only``)."""
    return {name: tensor_stats(t) for name, t in step_tensors(path, only)}


def diff_steps(a: dict[str, TensorStats], b: dict[str, TensorStats]) -> list[TensorDiff]:
    """The tensors that differ between two steps' fingerprints (bytes, shape or presence), by name."""
    out = []
    for name in sorted(set(a) | set(b)):
        sa, sb = a.get(name), b.get(name)
        if sa is None or sb is None or (sa.crc32c, sa.shape, sa.dtype) != (sb.crc32c, sb.shape, sb.dtype):
            out.append(TensorDiff(name, sa, sb))
    return out


def diff_step_dirs(a: Path | str, b: Path | str) -> list[TensorDiff]:
    """The tensors that differ between the steps at ``a`` and ``b``, each with the norm of its
    change: both steps are read tensor by tensor in name order (the memory of two of the largest
    tensor and their difference), never whole."""
    ita, itb = step_tensors(a), step_tensors(b)
    ta, tb = next(ita, None), next(itb, None)
    out = []
    while ta is not None or tb is not None:
        if tb is None or (ta is not None and ta[0] < tb[0]):
            out.append(TensorDiff(ta[0], tensor_stats(ta[1]), None))
            ta = next(ita, None)
        elif ta is None or tb[0] < ta[0]:
            out.append(TensorDiff(tb[0], None, tensor_stats(tb[1])))
            tb = next(itb, None)
        else:
            if (d := _diff_pair(ta[0], ta[1], tb[1])) is not None:
                out.append(d)
            ta, tb = next(ita, None), next(itb, None)
    return out


def _diff_pair(name: str, a: torch.Tensor, b: torch.Tensor) -> TensorDiff | None:
    sa, sb = tensor_stats(a), tensor_stats(b)
    if (sa.crc32c, sa.shape, sa.dtype) == (sb.crc32c, sb.shape, sb.dtype):
        return None
    delta = None
    if sa.shape == sb.shape:
        delta = float(torch.linalg.vector_norm(b.detach().to(torch.float64) - a.detach().to(torch.float64)))
    return TensorDiff(name, sa, sb, delta)


def shard_sums(views: dict[str, torch.Tensor], fqns: set[str]) -> dict[str, ShardSums]:
    """The sums of the floating-point tensors ``fqns`` among a rank's staged ``views`` (its shards, as
    its writer holds them after the write): merged over the ranks into the manifest's fingerprints.
    Only the tensors this rank writes are summed (DCP writes a replicated one from one rank only).
    The writer's own files are summed as they are written (``RankFiles.sums``); this is for a
    writing path that does not (DCP's fsspec writer)."""
    return {fqn: tensor_sums(views[fqn]) for fqn in sorted(fqns & set(views)) if views[fqn].is_floating_point()}


def merge_shard_sums(per_rank: list[dict[str, ShardSums]]) -> dict[str, dict[str, float | int]]:
    """The manifest's ``tensors``: each tensor's element count, sum and L2 norm of its finite elements,
    and NaN and Inf counts, over every rank's shard."""
    merged: dict[str, list[float]] = {}
    for sums in per_rank:
        for fqn, row in sums.items():
            acc = merged.setdefault(fqn, [0, 0.0, 0.0, 0, 0])
            for i, v in enumerate(row):
                acc[i] += v
    return {fqn: {"numel": int(n), "sum": s, "norm": math.sqrt(q), "nan": int(nan), "inf": int(inf)}
            for fqn, (n, s, q, nan, inf) in sorted(merged.items())}
