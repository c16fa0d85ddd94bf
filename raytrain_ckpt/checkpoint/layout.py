"""On-disk layout of a job's checkpoints and the commit protocol that makes a step valid.

::

    <checkpoint.dir>/<job name>/
        step-00000040/              committed: DCP shards, .metadata, manifest.json
        step-00000050.tmp-1a2b3c/   being written (or left over by a crash; removed on start)

A step directory is valid only if ``manifest.json`` parses, names this step, and every file
it lists exists with the recorded size (and CRC-32 when verifying checksums). The manifest is
written and fsynced last inside the temporary directory, which is then renamed atomically and
the parent fsynced: a reader sees either no ``step-N`` or a complete one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

__all__ = [
    "MANIFEST",
    "CheckpointLayout",
    "InvalidCheckpoint",
    "Manifest",
    "file_crc32",
]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-(\d+)\.tmp-[0-9a-f]+$")
_CHUNK = 8 << 20

Verify = Literal["size", "checksum"]


class InvalidCheckpoint(ValueError):
    """A step directory that must not be loaded, with the reason."""


@dataclass
class Manifest:
    """What a committed step contains; the commit record."""

    step: int
    world_size: int
    dp_size: int
    spec_hash: str
    files: dict[str, dict[str, int]]
    """File name -> {"size": bytes, "crc32": checksum}."""
    samples_seen: int = 0
    tokens_seen: int = 0
    wall: dict[str, float] = field(default_factory=dict)
    """Timings of the save: stage_s, persist_s, commit_s, total_s."""
    created_unix: float = 0.0
    format: int = MANIFEST_FORMAT
    pp_size: int = 1
    """Pipeline-parallel degree of the saving job (world_size = pp_size x dp_size); 1 in older manifests."""
    model: dict[str, Any] | None = None
    """The job's ``model`` section (name, overrides), so an export can name tensors and write a
    config without the spec; None in older manifests and imported weights."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data: dict[str, Any] = json.loads(text)
        if data.get("format") != MANIFEST_FORMAT:
            raise InvalidCheckpoint(f"manifest format {data.get('format')!r}, expected {MANIFEST_FORMAT}")
        return cls(**data)

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())


def file_crc32(path: Path) -> int:
    """CRC-32 of a file, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointLayout:
    """Names, scanning, verification and the atomic commit under one job's checkpoint root."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def new_tmp_dir(self, step: int) -> Path:
        """A fresh, empty directory to write ``step`` into."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"step-{step:08d}.tmp-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        return path

    def step_dirs(self) -> dict[int, Path]:
        """Every ``step-N`` entry (valid or not), by step."""
        if not self.root.is_dir():
            return {}
        out = {}
        for entry in self.root.iterdir():
            m = _STEP_RE.match(entry.name)
            if m:
                out[int(m.group(1))] = entry
        return out

    def remove_leftover_tmp(self) -> list[Path]:
        """Delete ``*.tmp-*`` directories left by saves that never committed."""
        removed = []
        if not self.root.is_dir():
            return removed
        for entry in self.root.iterdir():
            if _TMP_RE.match(entry.name):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
        if removed:
            logger.warning("removed %d uncommitted checkpoint dir(s): %s", len(removed),
                           ", ".join(p.name for p in removed))
        return removed

    def read_manifest(self, path: Path) -> Manifest:
        """The manifest of a step directory; raises InvalidCheckpoint."""
        if not path.is_dir():
            raise InvalidCheckpoint(f"{path} is not a directory")
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise InvalidCheckpoint(f"{path} has no {MANIFEST} (never committed)")
        try:
            return Manifest.from_json(mpath.read_text(encoding="utf-8"))
        except (ValueError, TypeError) as exc:
            raise InvalidCheckpoint(f"{mpath} is unreadable: {exc}") from None

    def verify(self, path: Path, level: Verify = "size") -> Manifest:
        """Check a step directory against its manifest; raises InvalidCheckpoint naming the problem."""
        manifest = self.read_manifest(path)
        m = _STEP_RE.match(path.name)
        if m is None or int(m.group(1)) != manifest.step:
            raise InvalidCheckpoint(f"{path} holds a manifest for step {manifest.step}")
        if ".metadata" not in manifest.files:
            raise InvalidCheckpoint(f"{path}: manifest lists no .metadata")
        for name, want in manifest.files.items():
            fpath = path / name
            if not fpath.is_file():
                raise InvalidCheckpoint(f"{fpath} is missing")
            size = fpath.stat().st_size
            if size != want["size"]:
                raise InvalidCheckpoint(f"{fpath} has {size} bytes, manifest says {want['size']} (truncated?)")
            if level == "checksum" and file_crc32(fpath) != want["crc32"]:
                raise InvalidCheckpoint(f"{fpath} fails its CRC-32 check (corrupt)")
        return manifest

    def valid_steps(self, level: Verify = "size") -> dict[int, Manifest]:
        """Steps whose directories verify; invalid ones are logged and skipped."""
        out = {}
        for step, path in sorted(self.step_dirs().items()):
            try:
                out[step] = self.verify(path, level)
            except InvalidCheckpoint as exc:
                logger.warning("skipping checkpoint step %d: %s", step, exc)
        return out

    def commit(self, tmp: Path, manifest: Manifest) -> Path:
        """Write the manifest, fsync it, rename ``tmp`` to ``step-N`` and fsync the parent.

        An existing ``step-N`` that does not verify (a torn earlier attempt) is moved aside to
        ``step-N.invalid-<id>`` first; a valid one is never replaced.
        """
        for name, want in manifest.files.items():
            size = (tmp / name).stat().st_size if (tmp / name).is_file() else -1
            if size != want["size"]:
                raise InvalidCheckpoint(f"{tmp / name}: {size} bytes on disk, {want['size']} reported; not committing")
        manifest.created_unix = time.time()
        mpath = tmp / MANIFEST
        with open(mpath, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        final = self.step_dir(manifest.step)
        if final.exists() or final.is_symlink():
            self._move_aside(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        return final

    def _move_aside(self, final: Path) -> None:
        try:
            self.verify(final, "checksum")  # rare: only when step-N already exists
        except InvalidCheckpoint as exc:
            aside = final.with_name(f"{final.name}.invalid-{uuid.uuid4().hex[:8]}")
            logger.warning("moving invalid %s aside to %s: %s", final.name, aside.name, exc)
            os.rename(final, aside)
            return
        raise FileExistsError(f"{final} is a valid checkpoint and is never overwritten")

    def delete(self, step: int) -> None:
        """Remove a committed step: rename out of the step namespace first, so a crash mid-delete leaves no torn step-N."""
        final = self.step_dir(step)
        doomed = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:12]}")
        os.rename(final, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
