"""The shape of a Llama-style model and its presets: plain data, no torch (the job spec checks it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRESETS", "LlamaConfig"]

_MAX_DIM = 2**31 - 1
"""The largest size a shape field may have."""


@dataclass(frozen=True)
class LlamaConfig:
    """Shape hyper-parameters of a :class:`Llama` model.

    Attributes:
        dim: Model (residual stream) width.
        n_layers: Number of transformer blocks.
        n_heads: Number of query heads.
        n_kv_heads: Number of key/value heads (grouped-query attention).
        vocab_size: Number of token ids.
        ffn_dim: Hidden width of the SwiGLU feed-forward network.
        max_seq_len: Longest sequence the RoPE tables cover.
        norm_eps: Epsilon of the RMSNorm layers.
        rope_theta: Base of the RoPE frequencies.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def num_params(self) -> int:
        """Scalar parameters of :class:`Llama` with this shape, counted without building it.

        Mirrors ``llama.py``: untied embedding and output head, bias-free projections, one
        RMSNorm weight per norm. A unit test compares it with the built model's ``numel``.
        """
        kv_width = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.n_heads * self.head_dim + 2 * self.dim * kv_width  # wq, wo; wk, wv
        block = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim  # w1, w2, w3; two norms
        return 2 * self.vocab_size * self.dim + self.n_layers * block + self.dim  # embeddings, head; final norm

    def validate(self) -> None:
        """Check the cross-field constraints of the shape.

        Raises:
            ValueError: If a field is non-positive or the head layout is
                inconsistent; the message names the fields and the fix.
        """
        ints = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len")
        for name in ints:
            value = getattr(self, name)
            # bool is an int subclass; a YAML 'true' must not become 1 silently.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"LlamaConfig.{name} must be an integer, got {value!r}")
            if value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {value}")
            if value > _MAX_DIM:  # a tensor dimension torch indexes with 32 bits at most
                raise ValueError(f"LlamaConfig.{name} must be at most {_MAX_DIM}, got {value}")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf")
                    or (isinstance(value, int) and value > _MAX_DIM)):
                raise ValueError(f"LlamaConfig.{name} must be a positive finite number, got {value!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"LlamaConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be divisible by "
                f"n_kv_heads ({self.n_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE; "
                "change dim or n_heads"
            )


PRESETS: dict[str, LlamaConfig] = {
    # ~0.85M params, byte-level vocab so it trains on raw text on a CPU.
    "debug": LlamaConfig(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=384, max_seq_len=512
    ),
    # ~25M params, still byte-level: big enough to show real throughput numbers.
    "small": LlamaConfig(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=1536, max_seq_len=1024
    ),
    # Llama 3.2 1B shape; untied output, so ~1.5B params instead of 1.24B.
    "1b": LlamaConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # Llama 3 8B shape (~8.03B params).
    "8b": LlamaConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}
