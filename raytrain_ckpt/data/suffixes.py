"""File suffixes read as text by ``data.source: text``, and the listing of an input directory
(torch-free: the spec checks paths with them)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

__all__ = ["TEXT_SUFFIXES", "input_files"]

TEXT_SUFFIXES: frozenset[str] = frozenset({".txt", ".md", ".rst", ".py", ".yaml", ".toml", ".json"})


def input_files(root: Path, suffixes: Collection[str]) -> list[Path]:
    """The files with one of ``suffixes`` (lower-cased) below ``root``, sorted.

    Raises:
        ValueError: One of them is not a regular file (a FIFO, a device, a socket, a link to
            nothing): reading a FIFO blocks until someone writes to it, so it is refused by its
            name, never opened.
    """
    files = []
    for p in sorted(root.rglob("*")):
        if p.suffix.lower() not in suffixes or p.is_dir():
            continue
        if not p.is_file():  # (is_file follows a link: a link to a regular file is read)
            raise ValueError(f"{p} is not a regular file (a FIFO, device, socket or broken link), and reading it "
                             "could block or fail; remove it from the input directory")
        files.append(p)
    return files
