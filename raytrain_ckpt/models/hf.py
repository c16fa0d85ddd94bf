"""Hugging Face names for a model, behind one small interface that export and import ask.

``HFAdapter`` is what ``checkpoint/interchange`` needs of a model to write or read Hugging Face
files: the HF name of each parameter and back, the parameters' shapes, and ``config.json``. The
built-in Llama's adapter (``LlamaHF``, HF ``LlamaForCausalLM``) lives here, beside the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from raytrain_ckpt.checkpoint.errors import ConversionError
from raytrain_ckpt.models.config import LlamaConfig

__all__ = ["HFAdapter", "LlamaHF", "hf_adapter", "hf_config", "hf_name", "our_name"]

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


class HFAdapter(Protocol):
    """What an export to (or an import from) Hugging Face files asks of a model."""

    def hf_name(self, fqn: str) -> str:
        """The HF name of one of the model's parameter FQNs; raises ConversionError for one it has none for."""
        ...

    def our_name(self, name: str) -> str:
        """The inverse of ``hf_name``; raises ConversionError for a name that is not one of the model's."""
        ...

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """FQN -> shape of every parameter, in the model's order (what a checkpoint must hold)."""
        ...

    def config(self, dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for the model's HF class, with its shape, in ``dtype``."""
        ...


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


@dataclass(frozen=True)
class LlamaHF:
    """The built-in Llama as HF ``LlamaForCausalLM``; ``cfg`` (its shape) is needed for shapes and
    ``config.json``, not for names (an import reads names only)."""

    cfg: LlamaConfig | None = None

    def hf_name(self, fqn: str) -> str:
        return hf_name(fqn)

    def our_name(self, name: str) -> str:
        return our_name(name)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        from raytrain_ckpt.models.llama import Llama

        assert self.cfg is not None, "a Llama's shapes need its config"
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in Llama(self.cfg).state_dict().items()}

    def config(self, dtype: torch.dtype) -> dict[str, Any]:
        assert self.cfg is not None, "a Llama's config.json needs its config"
        return hf_config(self.cfg, dtype)


def hf_adapter(cfg: LlamaConfig | None = None) -> HFAdapter:
    """The HF adapter of the built-in model of shape ``cfg`` (the only model with HF names)."""
    return LlamaHF(cfg)
