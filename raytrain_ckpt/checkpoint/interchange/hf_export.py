"""The ``hf`` format of an export: ``model-0000i-of-0000N.safetensors`` sharded by size,
``model.safetensors.index.json`` and ``config.json``, tensors under the names the model's
``HFAdapter`` gives (``models/hf.py``). Each shard's header is computed from the DCP metadata
before any data is read, so a shard is written front to back, one tensor at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raytrain_ckpt.checkpoint.errors import ConversionError
from raytrain_ckpt.checkpoint.interchange.formats import plan_shards, safetensors_header
from raytrain_ckpt.models.hf import HFAdapter

__all__ = ["TensorReader", "write_hf"]


class TensorReader(Protocol):
    """What writing an export reads of a step: its tensors' metadata, and one full tensor at a time."""

    def tensor_keys(self, prefix: str) -> dict[str, TensorStorageMetadata]: ...
    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor: ...
    def release(self, t: torch.Tensor) -> None: ...


def _hf_entries(reader: TensorReader, adapter: HFAdapter) -> list[tuple[str, str, tuple[int, ...]]]:
    """(hf name, checkpoint key, shape) in the model's parameter order, checked against the model's shapes."""
    expected = adapter.parameter_shapes()
    saved = {k.removeprefix("model."): tuple(v.size) for k, v in reader.tensor_keys("model.").items()}
    if set(saved) != set(expected):
        missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
        raise ConversionError(f"the checkpoint's model does not match the spec's model: missing {missing[:3]}, "
                          f"unexpected {extra[:3]}; pass the spec the job ran with (--spec, --set)")
    for name, shape in expected.items():
        if saved[name] != shape:
            raise ConversionError(f"{name}: checkpoint shape {list(saved[name])}, spec model shape {list(shape)}; "
                              "pass the spec the job ran with (--spec, --set model.overrides...)")
    return [(adapter.hf_name(k), f"model.{k}", shape) for k, shape in expected.items()]


def write_hf(reader: TensorReader, tmp: Path, adapter: HFAdapter, dtype: torch.dtype, max_shard: int,
             progress_bar: Callable[[int, str], Any]) -> tuple[int, int]:
    """Write the model's tensors of ``reader``'s step into ``tmp`` as HF safetensors shards of at
    most ``max_shard`` bytes, their index and ``config.json``, every file fsynced; returns
    (tensors, bytes of tensor data)."""
    entries = _hf_entries(reader, adapter)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [itemsize * int(torch.Size(shape).numel()) for _, _, shape in entries]
    shards = plan_shards(sizes, max_shard)
    weight_map: dict[str, str] = {}
    bar = progress_bar(len(entries), "export hf")
    for s, idx in enumerate(shards, 1):
        fname = f"model-{s:05d}-of-{len(shards):05d}.safetensors"
        with open(tmp / fname, "wb") as f:
            f.write(safetensors_header([(entries[i][0], entries[i][2]) for i in idx], dtype))
            for i in idx:
                t = reader.read(entries[i][1], dtype).contiguous()
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
                reader.release(t)
                weight_map[entries[i][0]] = fname
                bar.update(1)
            f.flush()
            os.fsync(f.fileno())
    bar.close()
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    _write_durably(tmp / "model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True))
    _write_durably(tmp / "config.json", json.dumps(adapter.config(dtype), indent=2))
    return len(entries), sum(sizes)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
