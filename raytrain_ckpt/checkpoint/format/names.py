"""How a step and a location are spelled: the one owner of ``step-N[.<kind>-<id>]`` names.

::

    <checkpoint.dir>/<job name>/
        step-00000040/                     committed: DCP shards, .metadata, manifest.json
        step-00000050.tmp-1a2b3c/          being written (or left over by a crash; removed on start)
        step-00000030.invalid-9f8e7d6c/    a torn step-N moved aside by a re-save of N or a resume (kept, never loaded)
        step-00000060.abandoned-5a4b3c2d/  a step of an abandoned timeline moved aside (kept, never loaded)

``step_name`` writes them, ``parse_entry`` reads them, and only an entry of kind ``committed``
can ever be a valid step. A location is a ``Path`` on a file system and a URI string on an
object store (``is_uri`` tells them apart by spelling alone).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Entry", "EntryKind", "Location", "check_file_name", "parent_of", "parse_entry", "step_name"]

Location = Path | str
"""A path under a storage: a ``Path`` on POSIX storage, a URI string on an object store."""

_ENTRY_RE = re.compile(r"step-([0-9]{8,})(?:\.([a-z]+)-([0-9a-f]+))?")


def parent_of(path: Location) -> Location:
    """The directory holding ``path`` (a step's checkpoint root): the URI's prefix for a URI."""
    return str(path).rstrip("/").rsplit("/", 1)[0] if isinstance(path, str) else path.parent


class EntryKind(enum.Enum):
    """What a ``step-N[.<kind>-<id>]`` entry under a job's checkpoint root is."""

    COMMITTED = "committed"
    """``step-N``: committed, if it verifies."""
    TMP = "tmp"
    """``step-N.tmp-<id>``: being written, or left by a crash or an interrupted delete."""
    INVALID = "invalid"
    """``step-N.invalid-<id>``: a step-N that did not verify, moved aside by a re-save of N or a resume past it."""
    ABANDONED = "abandoned"
    """``step-N.abandoned-<id>``: a step of a timeline that was abandoned (a resume from an older
    step), moved aside so the new timeline can reuse the number."""

    @property
    def is_loadable(self) -> bool:
        """Only a committed entry can be loaded; every moved-aside kind is listed, never loaded."""
        return self is EntryKind.COMMITTED


@dataclass(frozen=True)
class Entry:
    """A parsed entry name."""

    step: int
    kind: EntryKind
    name: str


def step_name(step: int, kind: EntryKind = EntryKind.COMMITTED, tag: str = "") -> str:
    """``step-00000040``, or ``step-00000040.<kind>-<tag>`` for the other kinds."""
    base = f"step-{step:08d}"
    return base if kind is EntryKind.COMMITTED else f"{base}.{kind.value}-{tag}"


def parse_entry(name: str) -> Entry | None:
    """The step and kind of a directory entry name; None for anything that is not a step entry.

    Only the canonical spelling counts (``step-00000040``, not ``step-40``), so one step has
    one committed name.
    """
    m = _ENTRY_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    if m.group(1) != f"{step:08d}":
        return None
    if m.group(2) is None:
        return Entry(step, EntryKind.COMMITTED, name)
    try:
        kind = EntryKind(m.group(2))
    except ValueError:
        return None
    return Entry(step, kind, name) if kind is not EntryKind.COMMITTED else None


def check_file_name(name: str) -> str:
    """``name`` if it is a plain file name inside a step directory; raises ValueError otherwise."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise ValueError(f"file name {name!r} is not a plain name inside the step directory")
    return name
