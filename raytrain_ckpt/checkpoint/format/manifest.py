"""The manifest of a committed step, validated, and the checksum it records for every file.

A manifest is read from a directory that may have been damaged, hand-edited or written by
someone else, so it is parsed into a strict pydantic model: every wrong type, a negative size,
a file name that is not a plain name inside the step directory, a missing checksum, is an
``InvalidCheckpoint`` with the field and the reason, never a ``TypeError`` or ``KeyError``
further down.

Unknown keys are refused (``extra="forbid"``) at the top level and in file entries: every
manifest this product ever wrote is a subset of today's fields (``pp_size`` and ``model``
arrived later and have defaults), so no old manifest needs tolerance, and an unknown key
means the file was not written by this product. ``wall`` and ``model`` stay free-form maps:
timings of the save and the job's model section, checked by their readers.

Checksums: format 2 manifests record CRC-32C (``crc32c``, hardware-accelerated, about 4x the
speed of zlib's CRC-32 here); format 1 manifests recorded zlib CRC-32 (``crc32``) and stay
readable and verifiable.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import crc32c as _crc32c
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.names import check_file_name

_MAX_INT64 = 2**63 - 1

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "METRICS", "Checksum", "FileEntry", "KeepBestRecord",
           "Manifest", "checksum_file", "checksum_view", "describe_file", "file_crc32"]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2
"""2: files carry ``crc32c``; 1 (still read): files carry zlib ``crc32``."""
METRICS = ("eval_loss", "loss")
"""Values a manifest may record per step, by which ``checkpoint.keep_best`` and ``export best`` rank steps."""
_READABLE_FORMATS = (1, 2)
_CHUNK = 8 << 20

Checksum = Literal["crc32c", "crc32"]
_ALGORITHMS: dict[str, Callable[[bytes, int], int]] = {
    "crc32c": lambda data, value: _crc32c.crc32c(data, value),
    "crc32": lambda data, value: zlib.crc32(data, value),
}
_NAMES = {"crc32c": "CRC-32C", "crc32": "CRC-32"}


class FileEntry(BaseModel):
    """What the manifest records about one file of the step."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    size: int = Field(ge=0)
    """Bytes."""
    crc32c: int | None = Field(default=None, ge=0, lt=1 << 32)
    """CRC-32C of the content (format 2)."""
    crc32: int | None = Field(default=None, ge=0, lt=1 << 32)
    """zlib CRC-32 of the content (format 1)."""

    @model_validator(mode="after")
    def _has_checksum(self) -> FileEntry:
        if self.crc32c is None and self.crc32 is None:
            raise ValueError("records no checksum (crc32c or crc32)")
        return self

    @property
    def checksum(self) -> tuple[Checksum, int]:
        """The algorithm this entry was recorded with and its value (CRC-32C preferred)."""
        if self.crc32c is not None:
            return "crc32c", self.crc32c
        assert self.crc32 is not None  # _has_checksum
        return "crc32", self.crc32


class KeepBestRecord(BaseModel):
    """``checkpoint.keep_best`` as a manifest records it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    metric: Literal["eval_loss", "loss"]
    mode: Literal["min", "max"]
    k: int = Field(ge=1)


class Manifest(BaseModel):
    """What a committed step contains; the commit record."""

    model_config = ConfigDict(extra="forbid", strict=True)

    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    dp_size: int = Field(ge=1)
    spec_hash: str
    files: dict[str, FileEntry]
    """File name (plain, inside the step directory) -> size and checksum."""
    samples_seen: int = Field(default=0, ge=0)
    tokens_seen: int = Field(default=0, ge=0)
    wall: dict[str, Annotated[float, Field(allow_inf_nan=False)]] = Field(default_factory=dict)
    """Timings of the save: stage_s, persist_s, commit_s, total_s."""
    created_unix: float = Field(0.0, allow_inf_nan=False)
    format: int = MANIFEST_FORMAT
    pp_size: int = Field(default=1, ge=1)
    """Pipeline-parallel degree of the saving job (world_size = pp_size x dp_size); 1 in older manifests."""
    model: dict[str, Any] | None = None
    """The job's ``model`` section (name, overrides), so an export can name tensors and write a
    config without the spec; None in older manifests and imported weights."""
    eval_loss: float | None = None
    """Validation loss after this step when an evaluation fell on it; None otherwise and in older manifests."""
    loss: float | None = None
    """Training loss of this step (over the global batch) when it was a log step; None otherwise
    and in older manifests."""
    keep_best: KeepBestRecord | None = None
    """The job's ``checkpoint.keep_best`` when it had one, so ``export best`` ranks steps as retention did."""
    certified_step: int | None = Field(default=None, ge=0)
    """The newest committed step the training guard had certified (that many healthy steps followed
    it) when this step was saved; retention never deletes the newest one. None: none yet, older manifests."""
    tensors: dict[str, dict[str, Annotated[float, Field(allow_inf_nan=False)]]] | None = None
    """Per-tensor fingerprints, summed by the writers from the staged bytes (off the training path):
    ``numel``, ``sum`` and ``norm`` of the finite elements, ``nan`` and ``inf`` counts. None in older
    manifests and imported steps."""
    skipped_samples: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=3, max_length=3)]] | None = None
    """Global sample windows the job skips after rollbacks, ``[from step, lo, hi]``: the samples
    ``[lo, hi)`` are never read from that step on; a resume keeps skipping them. None: none."""
    replica_skips: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=4, max_length=4)]] | None = None
    """With replica groups (``parallelism.dp_replicate``), each share a step up to this one trained
    without, ``[step, group, lo, hi]``: step ``step`` did not train the global samples ``[lo, hi)``
    (the group was out under the heal rule). With ``tokens_seen`` every sample is accounted for;
    a resume carries them on. None: none."""

    @field_validator("loss", "eval_loss", mode="before")
    @classmethod
    def _finite_or_null(cls, value: Any) -> Any:
        # a diverged run's NaN or inf loss is recorded as null: JSON has no NaN, and no step is
        # ranked by it (``keep_best`` and ``export best`` skip a step without the metric)
        return None if isinstance(value, float) and not math.isfinite(value) else value

    @field_validator("skipped_samples")
    @classmethod
    def _windows(cls, value: list[list[int]] | None) -> list[list[int]] | None:
        # the rules the guard's rollback applies when it records a window (an int64 sample
        # index, lo < hi): a resume computes start indices from them
        for step, lo, hi in value or ():
            if max(step, lo, hi) > _MAX_INT64 or lo >= hi:
                raise ValueError(f"skip window [{step}, {lo}, {hi}]: needs 0 <= lo < hi <= 2**63-1 "
                                 "(a window of the samples [lo, hi) from that step on)")
        return value

    @field_validator("replica_skips")
    @classmethod
    def _shares(cls, value: list[list[int]] | None) -> list[list[int]] | None:
        for step, group, lo, hi in value or ():
            if max(step, group, lo, hi) > _MAX_INT64 or lo >= hi or step < 1:
                raise ValueError(f"replica skip [{step}, {group}, {lo}, {hi}]: needs step >= 1 and "
                                 "0 <= lo < hi <= 2**63-1 (the samples [lo, hi) step `step` did not train)")
        return value

    @field_validator("files")
    @classmethod
    def _plain_names(cls, value: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for name in value:
            check_file_name(name)
        return value

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: int) -> int:
        if value not in _READABLE_FORMATS:
            raise ValueError(f"manifest format {value}, this release reads {_READABLE_FORMATS}")
        return value

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", exclude_none=True), indent=1, sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse and validate; raises InvalidCheckpoint naming the first bad field."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise InvalidCheckpoint(f"not JSON ({exc})") from None
        return cls.parse(data)

    @classmethod
    def parse(cls, data: Any) -> Manifest:
        """Validate decoded JSON; raises InvalidCheckpoint naming the first bad field."""
        if not isinstance(data, dict):
            raise InvalidCheckpoint(f"a JSON {type(data).__name__} where an object is expected")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "manifest"
            raise InvalidCheckpoint(f"{where}: {err['msg']}") from None
        except (ValueError, RecursionError) as exc:
            raise InvalidCheckpoint(f"invalid manifest ({exc})") from None

    def metrics(self) -> dict[str, float | None]:
        """The values of ``METRICS`` this step records (None: not recorded)."""
        return {name: getattr(self, name) for name in METRICS}

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def checksum_file(path: Path, algorithm: Checksum = "crc32c", progress: Callable[[int], None] | None = None) -> int:
    """The checksum of a file; ``progress`` gets the length of each chunk done.

    The file is memory-mapped, not read: checksumming the page cache in place is about 3x the
    speed of copying it out in chunks. Committed files are never truncated (a truncation under
    the map would be SIGBUS); a deleted one stays mapped until we are done.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return _ALGORITHMS[algorithm](b"", 0)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                value = checksum_view(view, algorithm, progress)
            finally:
                view.release()
    return value


def checksum_view(view: memoryview, algorithm: Checksum = "crc32c",
                  progress: Callable[[int], None] | None = None) -> int:
    """The checksum of bytes in memory (``checksum_file``'s loop: a mapped file, a staging buffer)."""
    update, value = _ALGORITHMS[algorithm], 0
    if len(view) == 0:
        return update(b"", 0)
    for offset in range(0, len(view), _CHUNK):
        chunk = view[offset:offset + _CHUNK]
        value = update(chunk, value)
        chunk.release()
        if progress is not None:
            progress(min(_CHUNK, len(view) - offset))
    return value


def checksum_name(algorithm: Checksum) -> str:
    """``CRC-32C`` / ``CRC-32``, for messages."""
    return _NAMES[algorithm]


def describe_file(path: Path) -> dict[str, int]:
    """The manifest entry of a written file: its size and CRC-32C."""
    return {"size": path.stat().st_size, "crc32c": checksum_file(path, "crc32c")}


def file_crc32(path: Path) -> int:
    """zlib CRC-32 of a file, the checksum of format 1 manifests. New code uses ``describe_file``."""
    return checksum_file(path, "crc32")
