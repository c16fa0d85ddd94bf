"""A Llama-style decoder-only transformer.

The module layout (one ``TransformerBlock`` per entry of ``Llama.layers``, no
shared or tied parameters) is chosen so that FSDP2 ``fully_shard`` can wrap
each block and then the root without any parameter appearing in two groups.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_ckpt.models.config import PRESETS, LlamaConfig
from raytrain_ckpt.models.init import init_parameters

logger = logging.getLogger(__name__)

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "TransformerBlock",
    "num_params",
]


def _rope_tables(cfg: LlamaConfig, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute RoPE cos/sin tables of shape ``[max_seq_len, head_dim]`` in fp32."""
    half = cfg.head_dim // 2
    exponents = torch.arange(0, half, device=device, dtype=torch.float32) / half
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    positions = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    # Duplicated so that the table lines up with the rotate-halves layout.
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, T, H, D]`` by position (rotate-halves form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    # Tables are fp32; cast so bf16 activations stay bf16 under FSDP mixed precision.
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary position embeddings."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``[B, T, dim]``; returns the same shape."""
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            # Explicit repeat instead of SDPA's enable_gqa: every backend accepts it.
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward network: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP to ``x`` of shape ``[..., dim]``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``h + ffn(norm(h))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Run the block on ``x`` of shape ``[B, T, dim]``."""
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama-style decoder: embeddings, ``n_layers`` blocks, norm, untied head.

    Args:
        cfg: Model shape; validated here.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0", "1", ... has the same FQNs as a ModuleList (layers.3.x), but a
        # pipeline stage can drop the blocks it does not own without renumbering the others.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = _rope_tables(cfg, self.output.weight.device)
        # Non-persistent: derived from the config, so they stay out of checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise all parameters and the RoPE tables.

        Each parameter is drawn from its own generator seeded from ``seed`` and its name
        (see ``models/init.py``), so the values do not depend on the order of visits, the
        world size, FSDP2 sharding or pipeline stages: a model built on the meta device,
        sharded and materialised with ``to_empty`` gets the same values as one built
        whole. Projections that write into the residual stream (``wo``, ``w2``) and the
        output head use std ``0.02 / sqrt(2 * n_layers)``, as in GPT-2; norms start at one.
        Also recomputes the RoPE buffers, which ``to_empty`` leaves uninitialised.

        Args:
            seed: Base seed; None takes ``torch.initial_seed()`` (the last ``torch.manual_seed``).
        """
        base = torch.initial_seed() if seed is None else seed
        init_parameters(self, base, self.init_parameter)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the RoPE tables only: what a model about to load a checkpoint still needs
        after ``to_empty`` (the load overwrites every parameter)."""
        self._reset_rope()

    def init_parameter(self, fqn: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full-shape tensor of parameter ``fqn`` (a :data:`ParamInit`)."""
        leaf = fqn.rsplit(".", 2)
        if fqn.endswith("norm.weight"):
            full.fill_(1.0)
            return
        residual = fqn == "output.weight" or leaf[-2] in ("wo", "w2")
        std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if residual else 0.02
        full.normal_(mean=0.0, std=std, generator=generator)

    def _reset_rope(self) -> None:
        """Recompute the RoPE tables in place on the buffers' device."""
        device = self.rope_cos.device
        if device.type == "meta":
            return
        cos, sin = _rope_tables(self.cfg, device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits.

        A pipeline stage holds only some of the modules (the others are None): without
        ``tok_embeddings`` the input is the previous stage's hidden state ``[B, T, dim]``,
        without ``norm``/``output`` the hidden state is returned.

        Args:
            tokens: LongTensor of shape ``[B, T]`` with ``T <= max_seq_len``.

        Returns:
            Logits of shape ``[B, T, vocab_size]``.
        """
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len {self.cfg.max_seq_len}; "
                "raise model max_seq_len or shorten data seq_len"
            )
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def num_params(model: nn.Module) -> int:
    """Count the parameters of ``model`` (works on the meta device).

    Args:
        model: Any module; parameters shared between submodules count once.

    Returns:
        The total number of scalar parameters.
    """
    return sum(p.numel() for p in model.parameters())
