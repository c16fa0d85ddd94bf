"""Reading a spec file, applying ``--set`` overrides, and turning validation errors into
``path[=value]: what is wrong; how to fix it`` lines."""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from raytrain_ckpt.spec.job import JobSpec
from raytrain_ckpt.spec.sections import FieldProblems, SpecError

__all__ = ["format_validation_error", "load_spec", "parse_overrides"]


SPEC_SUFFIXES = (".yaml", ".yml", ".json", ".toml")


# --- loading -----------------------------------------------------------------


def load_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read a YAML, JSON or TOML job spec, apply ``--set`` overrides and validate it.

    Args:
        path: The spec file.
        overrides: ``dotted.path=value`` strings; values are parsed as YAML scalars/lists.

    Returns:
        The validated spec.

    Raises:
        SpecError: The file is missing or unreadable, or the spec is invalid.
    """
    path = Path(path)
    raw = _read_file(path)
    for dotted, value in parse_overrides(overrides or []):
        _apply_override(raw, dotted, value)
    try:
        return JobSpec.model_validate(raw, context={"base_dir": path.resolve().parent})
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc)) from None


def _read_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise SpecError([f"{path}: spec file not found; pass the path of a .yaml, .json or .toml job spec"])
    if path.is_dir():
        raise SpecError([f"{path}: is a directory; pass a job spec file such as jobs/llama_debug_fsdp.yaml"])
    if path.suffix not in SPEC_SUFFIXES:
        raise SpecError([f"{path}: unknown spec format '{path.suffix}'; use one of {', '.join(SPEC_SUFFIXES)}"])
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise SpecError([f"{path}: not valid {path.suffix[1:].upper()}: {_one_line(exc)}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"{path}: the top level must be a mapping of sections, got {type(data).__name__}"])
    return data


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    """Parse ``a.b.c=value`` strings; the value is read as YAML (numbers, booleans, lists)."""
    out: list[tuple[str, Any]] = []
    for item in items:
        dotted, sep, text = item.partition("=")
        if not sep or not dotted or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", dotted):
            raise SpecError([f"--set {item!r}: expected path.to.field=value, e.g. --set training.steps=20"])
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as exc:
            raise SpecError([f"--set {item!r}: value is not valid YAML: {_one_line(exc)}"]) from None
        out.append((dotted, value))
    return out


def _apply_override(raw: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = ".".join(keys[: i + 1])
            raise SpecError([f"--set {dotted}: {where} is a value ({child!r}), not a section"])
        node = child
    node[keys[-1]] = value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# --- error formatting ----------------------------------------------------------


def format_validation_error(exc: ValidationError) -> list[str]:
    """Turn pydantic errors into ``path[=value]: problem; fix`` lines."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldProblems):
            lines.extend(f"{_join(loc + [p])}: {m}" for p, m in cause.problems)
        else:
            lines.append(_format_one(loc, err))
    return lines


def _join(parts: list[str]) -> str:
    return ".".join(p for p in parts if p)


def _format_one(loc: list[str], err: dict[str, Any]) -> str:
    path, kind, msg = _join(loc), err["type"], err["msg"]
    if kind == "extra_forbidden":
        return f"{path}: unknown field{_suggest(loc)}"
    if kind == "missing":
        return f"{path}: required field is missing"
    msg = msg.removeprefix("Value error, ")
    if kind == "literal_error":
        msg = msg.replace("Input should be", "must be")
    value = err.get("input")
    if isinstance(value, (dict, list)) or value is None:
        return f"{path}: {msg}"
    return f"{path}={value}: {msg}"


def _suggest(loc: list[str]) -> str:
    model: type[BaseModel] = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return ""
        model = ann
    names = list(model.model_fields)
    close = difflib.get_close_matches(loc[-1], names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{hint} (valid fields: {', '.join(names)})"
