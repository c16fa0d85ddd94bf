"""The ``model``, ``data`` and ``eval`` sections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from raytrain_ckpt.models import PRESETS, describe_model, resolve_factory
from raytrain_ckpt.spec.sections.base import (
    FieldProblems,
    _BUILTIN_SOURCES,
    _Section,
    _builtin_or_import_path,
    _resolve_existing,
    _text_path_problem,
)

__all__ = ["DataSpec", "EvalSpec", "ModelSpec"]


class ModelSpec(_Section):
    name: str = "debug"
    """Built-in preset (debug, small, 1b, 8b) or a user factory 'package.module:function' that returns an nn.Module."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Preset fields to change (e.g. n_layers: 2), or keyword arguments passed to the factory."""

    @model_validator(mode="after")
    def _resolvable(self) -> ModelSpec:
        if ":" in self.name:
            try:
                resolve_factory(self.name)
            except ValueError as exc:
                raise FieldProblems([("name", str(exc))]) from None
            return self
        if self.name not in PRESETS:
            raise FieldProblems([("name", f"'{self.name}' is neither a preset ({', '.join(PRESETS)}) "
                                          "nor a factory path 'package.module:function'")])
        try:
            describe_model(self.name, self.overrides)
        except ValueError as exc:
            raise FieldProblems([("overrides", str(exc))]) from None
        return self


class DataSpec(_Section):
    source: str = "synthetic"
    """synthetic: a seeded, learnable token stream; text: byte-level tokens (vocab 256) from text files; tokens: pre-tokenized shards (.bin flat arrays of data.dtype, or .npy), memory-mapped; or a factory 'package.module:function' returning a map-style dataset of token-id sequences."""
    path: Path | None = Field(None, strict=False)
    """File or directory of text (source=text) or of token shards (source=tokens); a relative path is resolved against the spec file's directory."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Token type of .bin shards (source=tokens); .npy shards carry their own."""
    bos_id: int | None = Field(None, ge=0)
    """Token id put before every sample (its window is then seq_len tokens of the data); null: none."""
    eval_path: Path | None = Field(None, strict=False)
    """Held-out token shards for evaluation (source=tokens), read like path; null: see eval_fraction."""
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    """Carve this fraction of the samples (the last windows of the corpus, or the last dataset items) off as the held-out split; training never sees them."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a data.source factory."""
    skip_samples: list[list[int]] = Field(default_factory=list)
    """Windows of global sample indices never read, each [from_step, lo, hi]: from that step on the samples [lo, hi) are skipped (what a guard rollback records in the manifest's skipped_samples; a resume adds the manifest's windows)."""

    @field_validator("skip_samples")
    @classmethod
    def _windows(cls, value: list[list[int]]) -> list[list[int]]:
        for row in value:
            if len(row) != 3 or min(row) < 0 or row[2] <= row[1]:
                raise ValueError(f"window {row} is not [from_step, lo, hi] with 0 <= lo < hi and from_step >= 0")
        return value

    @field_validator("source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        why = _builtin_or_import_path(value, _BUILTIN_SOURCES, "data.source factory",
                                      f"must be {', '.join(_BUILTIN_SOURCES)} or a dataset factory "
                                      "'package.module:function'")
        if why:
            raise ValueError(why)
        return value

    @field_validator("path")
    @classmethod
    def _resolve_path(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        path = _resolve_existing(value, info, "a text file, a token shard or a directory of them")
        problem = _text_path_problem(path) if path is not None and info.data.get("source") == "text" else None
        if problem:
            raise ValueError(f"{problem}; point it at a text file or a directory of them")
        return path

    @field_validator("eval_path")
    @classmethod
    def _resolve_eval_path(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return _resolve_existing(value, info, "a token shard or a directory of shards")

    @model_validator(mode="after")
    def _path_matches_source(self) -> DataSpec:
        problems = _data_problems(self)
        if problems:
            raise FieldProblems(problems)
        return self

    @property
    def is_factory(self) -> bool:
        """source names a user dataset factory."""
        return self.source not in _BUILTIN_SOURCES


def _data_problems(d: DataSpec) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if d.is_factory:
        if d.path is not None or d.eval_path is not None:
            out.append(("path", "a data.source factory reads its own data; remove path/eval_path"))
        return out
    if d.source in ("text", "tokens") and d.path is None:
        out.append(("path", f"required when source={d.source}; set it to a file or directory"))
    if d.source == "synthetic" and d.path is not None:
        out.append(("path", "only used with source=text or tokens; remove it or set data.source"))
    if d.eval_path is not None and d.source != "tokens":
        out.append(("eval_path", "only used with source=tokens; use eval_fraction to hold out part of the data"))
    if d.eval_path is not None and d.eval_fraction is not None:
        out.append(("eval_fraction", "set either eval_path or eval_fraction, not both"))
    if d.source in ("synthetic", "text") and d.eval_fraction is not None:
        out.append(("eval_fraction", f"not supported with source={d.source}; use source=tokens or a factory"))
    if d.kwargs:
        out.append(("kwargs", "only used with a data.source factory; remove it"))
    if d.bos_id is not None and d.source != "tokens":
        out.append(("bos_id", f"not used with source={d.source}; use source=tokens or a factory, or remove it"))
    return out


class EvalSpec(_Section):
    every_steps: int = Field(..., ge=1)
    """Compute the validation loss after every this many steps (and after the last one)."""
    batches: int = Field(4, ge=1)
    """Held-out global batches (training.global_batch_size samples each) per evaluation: the same samples every time, on every layout."""
