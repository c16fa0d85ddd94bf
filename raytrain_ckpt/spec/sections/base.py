"""What every section shares: ``SpecError``, ``FieldProblems``, the strict ``_Section`` base, the
bounds of numbers and seconds, and the checks of paths and import paths several sections use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from raytrain_ckpt.common.events import printable
from raytrain_ckpt.common.locations import home_problem, mask_uri
from raytrain_ckpt.data.suffixes import TEXT_SUFFIXES, input_files
from raytrain_ckpt.models import resolve_factory

__all__ = ["FieldProblems", "MAX_INT", "MAX_RESOURCE_PER_WORKER", "MAX_SECONDS", "MAX_STEP", "MIN_MB_PER_S", "MIN_SECONDS", "RESOURCE_UNIT", "RESUME_VALUES", "SpecError", "is_ascii_digits"]


class SpecError(ValueError):
    """A user mistake in a job spec: one human-readable line per problem (a secret in a URI masked)."""

    def __init__(self, problems: list[str]) -> None:
        problems = [printable(mask_uri(p)) for p in problems]
        super().__init__("\n".join(problems))
        self.problems = problems


class FieldProblems(ValueError):
    """Cross-field problems raised inside a validator, each with its own field path."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{p}: {m}" for p, m in problems))
        self.problems = problems


class _Section(BaseModel):
    # strict: `steps: true` or `steps: 1.5` is a mistake, not 1; allow_inf_nan: `.inf` is never a setting.
    # Paths and the betas pair opt out of strictness per field (a str is a fine path, a list a fine pair).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, strict=True,
                              allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _within_64_bits(cls, value: Any) -> Any:
        # After each field's own bounds (which say more): any whole number beyond 64 bits validates
        # and then overflows in torch, Ray or a manifest at run time.
        if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT - 1 <= value <= MAX_INT:
            raise ValueError(f"a number of {len(str(abs(value)))} digits, beyond 64 bits; give at most {MAX_INT}")
        return value


MAX_INT = 2**63 - 1
"""The largest whole number a spec field may hold (19 digits): torch, Ray and the manifests keep
counts and seeds in 64-bit integers, so a larger one would validate and then overflow at run time."""

RESUME_VALUES = "must be latest, none, a step number, or the path of an existing step directory"
"""What checkpoint.resume takes, as its errors say."""

MAX_SECONDS = 1e9
"""The longest duration a spec field may give (about 31 years): a timer longer than this is
never what is meant, and Python's waits and timedeltas refuse ones much longer."""

MIN_SECONDS = 0.001
"""The shortest duration a spec field may give: a timer below a millisecond expires before
anything it waits for could happen (and a collective's timeout of 0 fails at once)."""
MAX_STEP = MAX_INT
"""The largest step number (64 bits, as the manifests and torch record it)."""
RESOURCE_UNIT = 0.0001
"""Ray's granularity of a fractional resource: it refuses a quantity finer than this."""
MAX_RESOURCE_PER_WORKER = 1e6
"""The most CPUs or GPUs one worker may reserve (no node has more; Ray keeps quantities in fixed point)."""
MIN_MB_PER_S = 0.001
"""The slowest rate a bandwidth limit may set (1 KB/s): below it a send's wait overflows."""

_BUILTIN_SOURCES = ("synthetic", "text", "tokens")


def _resolve_existing(value: Path | None, info: ValidationInfo, what: str) -> Path | None:
    """Resolve a relative path against the spec file's directory; it must exist."""
    if value is None:
        return None
    base = (info.context or {}).get("base_dir")
    path = _known_home(value).expanduser()
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    if not _exists(path):
        raise ValueError(f"{value} does not exist (resolved to {path}); point it at {what}")
    return path.resolve()


def _exists(path: Path) -> bool:
    """``path.exists()``, with the lookup's own error (a name too long, a directory that cannot be
    searched) as the ValueError a user reads instead of an OSError."""
    try:
        return path.exists()
    except OSError as exc:
        raise ValueError(f"cannot be looked up ({exc.strerror or exc})") from None


def _builtin_or_import_path(value: str, builtins: tuple[str, ...], kind: str, not_a_path: str) -> str | None:
    """The problem with ``value`` as a built-in name or an import path ``package.module:name``
    (``not_a_path`` when it is neither), or None when it is fine."""
    if value in builtins:
        return None
    if ":" not in value:
        return not_a_path
    return _check_import_path(value, kind)


def _check_import_path(value: str, kind: str) -> str | None:
    """None when ``value`` names an importable callable, else why not."""
    try:
        resolve_factory(value, kind)
    except ValueError as exc:
        return str(exc)
    return None


def _at_least(value: float | None, floor: float, unit: str) -> float | None:
    """``value`` when it is null or at least ``floor`` (a duration or rate below it cannot work)."""
    if value is not None and value < floor:
        raise ValueError(f"{value!r} {unit} is below {floor:g} {unit}, the least this setting can work with; "
                         f"give {floor:g} or more")
    return value


def is_ascii_digits(text: str) -> bool:
    """``"40"`` but not ``"\u00b2"``: str.isdigit alone accepts Unicode digits that int() rejects."""
    return text.isascii() and text.isdigit()


def _text_path_problem(path: Path) -> str | None:
    """Why ``path`` cannot be the text corpus (a device, a FIFO, a directory without text files), or None."""
    if path.is_file():
        return None
    if not path.is_dir():
        return f"{path} is not a regular file or a directory (a device, FIFO or socket)"
    try:
        found = input_files(path, TEXT_SUFFIXES)
    except ValueError as exc:  # a FIFO among them, which the run would block on
        return str(exc)
    if not found:
        return f"directory {path} has no text files (suffixes {', '.join(sorted(TEXT_SUFFIXES))})"
    return None


def _known_home(path: Path) -> Path:
    """``path``, whose leading ``~`` or ``~user`` (if any) can be expanded."""
    problem = home_problem(path)
    if problem:
        raise ValueError(problem)
    return path
