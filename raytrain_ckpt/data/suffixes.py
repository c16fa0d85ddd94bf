"""File suffixes read as text by ``data.source: text`` (torch-free: the spec checks paths with it)."""

from __future__ import annotations

__all__ = ["TEXT_SUFFIXES"]

TEXT_SUFFIXES: frozenset[str] = frozenset({".txt", ".md", ".rst", ".py", ".yaml", ".toml", ".json"})
