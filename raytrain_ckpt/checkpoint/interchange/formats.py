"""The file formats an export writes, and the names in them: Hugging Face Llama names for our
FQNs, ``config.json``, size-bounded shard plans, a safetensors header computed ahead of the
data, and ``torch.save``'s zip layout written one storage record at a time.

Both writers put the tensor data last, after a header that needs only names, dtypes and shapes,
so an export can read each tensor just before writing it.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import re
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from raytrain_ckpt.models.llama import LlamaConfig

__all__ = ["ConversionError", "hf_config", "hf_name", "lazy_tensor", "our_name", "plan_shards",
           "safetensors_header", "stream_torch_save"]

_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_STORAGE_TYPES: dict[torch.dtype, type] = {
    torch.float32: torch.FloatStorage, torch.bfloat16: torch.BFloat16Storage, torch.float16: torch.HalfStorage,
    torch.float64: torch.DoubleStorage, torch.int64: torch.LongStorage, torch.int32: torch.IntStorage,
}
_HF_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# Our FQN -> the Hugging Face LlamaForCausalLM name. Our RoPE is the rotate-halves form, the
# same as HF's rotate_half, so q/k need no permutation.
_HF_NAMES: list[tuple[str, str]] = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]



class ConversionError(ValueError):
    """A bad export or import request, or an unusable checkpoint: one line saying what and how to fix it."""


def _rename(name: str, to_hf: bool) -> str | None:
    for ours, hf in _HF_NAMES:
        src, dst = (ours, hf) if to_hf else (hf, ours)
        m = re.fullmatch(re.escape(src).replace(r"\{i\}", r"(?P<i>\d+)"), name)
        if m:
            return dst.format(**m.groupdict())
    return None


def hf_name(fqn: str) -> str:
    """The Hugging Face Llama name of one of our built-in model's parameter FQNs."""
    name = _rename(fqn, to_hf=True)
    if name is None:
        raise ConversionError(f"parameter {fqn!r} has no Hugging Face Llama name: --format hf exports only the built-in "
                          "Llama; use --format torch")
    return name


def our_name(name: str) -> str:
    """The inverse of :func:`hf_name`."""
    fqn = _rename(name, to_hf=False)
    if fqn is None:
        raise ConversionError(f"tensor {name!r} is not a Hugging Face Llama parameter of the built-in model")
    return fqn


def hf_config(cfg: LlamaConfig, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM`` with this model's shape."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "initializer_range": 0.02, "torch_dtype": _HF_DTYPE[dtype],
    }


def plan_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive groups of entry indices, each at most ``max_bytes`` unless one tensor is larger."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if shards[-1] and used + n > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += n
    return shards


def safetensors_header(items: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> bytes:
    """The length-prefixed JSON header of a safetensors file whose tensors follow in ``items`` order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, shape in items:
        n = itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class _Storage:
    """Stands for a storage in the pickle; its bytes are written after ``data.pkl``."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _LazyTensor:
    """Pickles exactly as a contiguous CPU tensor of ``shape`` over ``storage`` would."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: int) -> tuple:
        stride = torch.empty(self.shape, device="meta").stride()
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, torch.Size(self.shape), stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> tuple | None:
        if isinstance(obj, _Storage):
            return ("storage", _STORAGE_TYPES[obj.dtype], obj.key, "cpu", obj.numel)
        return None


def lazy_tensor(record: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
    """A placeholder that pickles as a tensor whose storage is the zip record ``data/<record>``."""
    return _LazyTensor(_Storage(record, dtype, int(torch.Size(shape).numel())), tuple(shape))


def stream_torch_save(path: Path, obj: Any, records: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write ``obj`` (holding ``lazy_tensor`` placeholders) in ``torch.save``'s zip format, then each
    (record, tensor) of ``records`` as it comes: the pickle goes first and refers to storages by
    record name, the layout ``torch.save`` produces, so ``torch.load`` (``weights_only``, ``mmap``)
    reads it. ``records`` may be a generator that reads each tensor just before it is written."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    with open(path, "wb") as f:
        writer = torch._C.PyTorchFileWriter(f)  # a file object: we fsync it before the rename
        try:
            writer.write_record("data.pkl", buf.getvalue(), len(buf.getvalue()))
            writer.write_record("byteorder", sys.byteorder.encode(), len(sys.byteorder))
            for record, tensor in records:
                storage = tensor.contiguous().untyped_storage()
                writer.write_record(f"data/{record}", storage, storage.nbytes())
        except BaseException:
            # An unfinished writer finishes the zip in its C++ destructor. The traceback keeps it
            # alive until after `f` is closed, and that write to a closed file raises inside the
            # destructor, which aborts the process. Finish it now, while `f` is open; the caller
            # removes the partial file. After a failed write (a full disk) finishing fails too; the
            # write's own error is the one to report.
            with contextlib.suppress(RuntimeError, OSError):
                writer.write_end_of_file()
            raise
        writer.write_end_of_file()
        f.flush()
        os.fsync(f.fileno())
