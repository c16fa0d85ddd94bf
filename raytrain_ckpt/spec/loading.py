"""Reading a spec file, applying ``--set`` overrides, and turning validation errors into
``path[=value]: what is wrong; how to fix it`` lines."""

from __future__ import annotations

import difflib
import json
import math
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from raytrain_ckpt.spec.job import JobSpec
from raytrain_ckpt.spec.sections import MAX_INT, FieldProblems, SpecError

__all__ = ["apply_overrides", "format_validation_error", "parse_overrides", "parse_spec", "read_spec"]


SPEC_SUFFIXES = (".yaml", ".yml", ".json", ".toml")
MAX_SPEC_BYTES = 1 << 20
"""A job spec is a page of settings; a bigger file is a wrong path (a log, a dataset, /dev/zero)."""
MAX_DEPTH = 32
"""Deepest nesting of sections, lists and mappings a spec may have (the schema needs 3)."""
MAX_VALUES = 100_000
"""Most values a spec may hold once YAML aliases are expanded: bounds an alias bomb before it expands."""
_PRINTABLE_BITS = 14_000
"""Whole numbers longer than this (about 4,200 digits) Python refuses to print or to read from text."""
MAX_SHOWN = 120
"""Characters of a value an error line repeats; a longer one is cut, with its length said."""


class _Limits(ValueError):
    """The document is nested too deep or holds too many values; the message says which."""


class _SpecLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts each node with its aliases expanded and bounds the nesting.

    The count is taken while composing, before any Python object is built, so ``&a [*a, *a, ...]``
    chains are refused at the limit instead of expanding in whatever walks the result later.
    A key given twice in one mapping is refused too: YAML would keep the last one silently, so a
    second ``checkpoint:`` section would drop the first without a word.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, int] = {}
        self._keys: list[str] = []

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        alias = self.check_event(yaml.AliasEvent)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Limits(f"nested deeper than {MAX_DEPTH} levels; a job spec needs 3 (section, field, value)")
        self._keys.append(str(index.value) if isinstance(index, yaml.ScalarNode) else "?")
        try:
            node = super().compose_node(parent, index)
            if isinstance(node, yaml.MappingNode) and not alias:
                self._check_unique_keys(node)
        finally:
            self._depth -= 1
            self._keys.pop()
        if alias:
            if id(node) not in self._sizes:
                raise _Limits("a YAML alias refers to its own anchor (a recursive structure)")
            return node
        children = node.value if isinstance(node, yaml.SequenceNode) else (
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
        size = 1 + sum(self._sizes[id(c)] for c in children)
        if size > MAX_VALUES:
            raise _Limits(f"more than {MAX_VALUES} values once YAML aliases (*name) are expanded; write the "
                          "values out, a job spec is small")
        self._sizes[id(node)] = size
        return node

    def _check_unique_keys(self, node: yaml.MappingNode) -> None:
        seen: dict[tuple[str, str], yaml.Node] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            if key.tag != "tag:yaml.org,2002:str":  # YAML 1.1 reads on/off/yes/no, numbers and null as values
                where = ".".join([k for k in self._keys if k != "?"] + [key.value])
                kind = {"bool": "true or false", "int": "a number", "float": "a number", "null": "null"}.get(
                    key.tag.rsplit(":", 1)[-1], key.tag)
                raise _Limits(f"{where}: the key {key.value!r} (line {key.start_mark.line + 1}) is read by YAML as "
                              f"{kind}, not as a name; quote it: '{key.value}':")
            first = seen.setdefault((key.tag, key.value), key)
            if first is not key:
                where = ".".join([k for k in self._keys if k != "?"] + [key.value])
                raise _Limits(f"{where}: given twice (lines {first.start_mark.line + 1} and "
                              f"{key.start_mark.line + 1}); the second would silently replace the first: keep one")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of ``json.loads``: a key given twice in one object is refused."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Limits(f"key {key!r} given twice in one object; the second would silently replace the first: "
                          "keep one")
        out[key] = value
    return out


# YAML 1.1 (PyYAML) reads 1e-4 as a string: a float needs a dot there. Specs are written the
# YAML 1.2 / JSON way (lr: 3e-4), so numbers in exponent form without a dot are floats too.
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _yaml_load(text: str) -> Any:
    loader = _SpecLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


# --- loading -----------------------------------------------------------------


def apply_overrides(raw: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Apply ``--set`` strings (``"training.steps=20"``) to a spec shaped as the file is, in place.

    The one reading of ``--set``, for spec files and for the Python API's dicts alike.

    Returns:
        ``raw``, for chaining.

    Raises:
        SpecError: An override is malformed or names a value as if it were a section.
    """
    for dotted, value in parse_overrides(overrides or []):
        _apply_override(raw, dotted, value)
    return raw


def read_spec(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """A spec file's sections with ``--set`` overrides applied, not yet validated.

    Raises:
        SpecError: The file is missing, unreadable or not a spec, or an override is malformed.
    """
    return apply_overrides(_read_file(Path(path)), overrides)


def parse_spec(raw: dict[str, Any], base_dir: Path) -> JobSpec:
    """Validate a spec shaped as the file is (its own rules only, not this machine: see
    ``raytrain_ckpt/control/preflight.py``).

    Args:
        raw: The spec's sections, overrides already applied.
        base_dir: What relative paths in the spec are relative to (the spec file's directory).

    Raises:
        SpecError: One line per problem.
    """
    _check_values(raw, "", "the spec")  # (a dict from the Python API has not been through a file's checks)
    try:
        return JobSpec.model_validate(raw, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc)) from None


def _read_file(path: Path) -> dict[str, Any]:
    text = _read_text(path)
    kind = path.suffix[1:].upper()
    try:
        if path.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_pairs)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = _yaml_load(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise SpecError([f"{path}: not valid {kind}: {_one_line(exc)}"]) from None
    except _Limits as exc:
        raise SpecError([f"{path}: {exc}"]) from None
    except ValueError as exc:  # a number of thousands of digits: Python's int() refuses to convert it
        raise SpecError([f"{path}: {_too_long_number(exc)}"]) from None
    except RecursionError:
        raise SpecError([f"{path}: nested deeper than {MAX_DEPTH} levels; a job spec needs 3 "
                         "(section, field, value)"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"{path}: the top level must be a mapping of sections, got {type(data).__name__}"])
    _check_values(data, "", path)
    return data


def _read_text(path: Path) -> str:
    """The file's text, after checking it is a small regular UTF-8 file (never blocks on a FIFO or device)."""
    hint = "pass the path of a .yaml, .json or .toml job spec"
    try:
        st = path.stat()
    except OSError as exc:
        what = "spec file not found" if isinstance(exc, FileNotFoundError) else exc.strerror
        raise SpecError([f"{path}: {what}; {hint}"]) from None
    if path.is_dir():
        raise SpecError([f"{path}: is a directory; pass a job spec file such as jobs/llama_debug_fsdp.yaml"])
    if path.suffix not in SPEC_SUFFIXES:
        raise SpecError([f"{path}: unknown spec format '{path.suffix}'; use one of {', '.join(SPEC_SUFFIXES)}"])
    if not path.is_file():
        raise SpecError([f"{path}: not a regular file (a device, FIFO or socket); {hint}"])
    if st.st_size > MAX_SPEC_BYTES:
        raise SpecError([f"{path}: {st.st_size} bytes, more than a job spec's {MAX_SPEC_BYTES}; {hint}"])
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise SpecError([f"{path}: cannot read it ({exc.strerror}); {hint}"]) from None
    except UnicodeDecodeError as exc:
        raise SpecError([f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                         "save the spec as UTF-8"]) from None


def _too_long_number(exc: ValueError) -> str:
    return (f"holds a number too long to read ({str(exc).split(';')[0]}); a setting is a whole number up to "
            f"{MAX_INT} ({len(str(MAX_INT))} digits) or a decimal number")


def _check_values(value: Any, where: str, path: Path | str) -> None:
    """Refuse non-finite and subnormal floats anywhere (also inside model.overrides), whole numbers
    beyond 64 bits, bytes (YAML's ``!!binary``), and nesting past MAX_DEPTH.

    Iterative, so that a deep JSON or TOML document is reported instead of exhausting the stack.
    """
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, at, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise SpecError([f"{path}: {at or 'the spec'} is nested deeper than {MAX_DEPTH} levels; "
                             "a job spec needs 3 (section, field, value)"])
        if isinstance(item, float) and not math.isfinite(item):
            raise SpecError([f"{at}={item}: must be a finite number (inf and nan are never valid settings); "
                             "give a number"])
        if isinstance(item, float) and 0 < abs(item) < sys.float_info.min:
            raise SpecError([f"{at}={item}: is subnormal (closer to 0 than {sys.float_info.min:.1e}): arithmetic "
                             "on it underflows to 0; give 0 or a larger number"])
        if isinstance(item, int) and item.bit_length() > _PRINTABLE_BITS:  # (a dict of the Python API)
            raise SpecError([f"{at}: a number of thousands of digits; a setting is a whole number up to {MAX_INT}"])
        if isinstance(item, (bytes, bytearray)):  # YAML's !!binary: no setting is bytes, and none is read as them
            raise SpecError([f"{at or 'the spec'}: is a !!binary value (bytes); a setting is text, a number or "
                             "true/false: remove the !!binary tag and write the value itself"])
        if isinstance(item, str) and not _is_unicode_text(item):
            raise SpecError([f"{at or 'the spec'}: holds a lone surrogate (an escape such as \\ud800 that is half of a "
                             "character), which no file name or log line can carry; write the character itself"])
        children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        stack.extend((v, _join([at, str(k)]), depth + 1) for k, v in children)
        if isinstance(item, dict):
            stack.extend((k, _join([at, "<key>"]), depth + 1) for k in item if isinstance(k, str))


def _is_unicode_text(text: str) -> bool:
    """False for a string YAML or JSON built from escaped surrogates (``"\\ud800\\udc00"``): Python keeps
    them as lone surrogates, which UTF-8 cannot encode, so every later print or path use would raise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    """Parse ``a.b.c=value`` strings; the value is read as YAML (numbers, booleans, lists)."""
    out: list[tuple[str, Any]] = []
    for item in items:
        dotted, sep, text = item.partition("=")
        if not sep or not dotted or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", dotted):
            raise SpecError([f"--set {_shown(item)}: expected path.to.field=value, e.g. --set training.steps=20"])
        try:
            value = _yaml_load(text) if text != "" else ""
        except (yaml.YAMLError, _Limits, RecursionError) as exc:
            raise SpecError([f"--set {_shown(item)}: value is not valid YAML: {_one_line(exc)}"]) from None
        except ValueError as exc:  # (a number of thousands of digits)
            raise SpecError([f"--set {dotted}: {_too_long_number(exc)}"]) from None
        _check_values(value, dotted, "--set")
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
    branched: set[str] = set()
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldProblems):
            lines.extend(f"{_join(loc + [p])}: {m}" for p, m in cause.problems)
            continue
        field = [p for p in loc if not _is_union_branch(p)]
        if field != loc:  # one error per member of a union type (Path | str): one line for the field
            if _join(field) in branched:
                continue
            branched.add(_join(field))
            err = {**err, "type": "null_given"} if err.get("input") is None else {**err, "type": "string_type"}
        lines.append(_format_one(field, err))
    return lines


def _is_union_branch(part: str) -> bool:
    """A location part pydantic adds for a member of a union (``str``, ``lax-or-strict[...]``), not a field."""
    return "[" in part or part in ("str", "int", "float", "bool", "none")


def _join(parts: list[str]) -> str:
    return ".".join(p for p in parts if p)


def _format_one(loc: list[str], err: dict[str, Any]) -> str:
    path, kind, msg = _join(loc), err["type"], err["msg"]
    if kind == "extra_forbidden":
        return f"{path}: unknown field{_suggest(loc)}"
    if kind == "missing":
        return f"{path}: required field is missing"
    if kind == "null_given":
        return f"{path}: null is not a value here; give one, or leave the field out for its default"
    if path in _FIELD_HINTS and kind in _TYPE_HINTS:
        return f"{path}={_shown(err.get('input'))}: {_FIELD_HINTS[path]} (got {type(err.get('input')).__name__})"
    if kind in _TYPE_HINTS:
        return f"{path}={_shown(err.get('input'))}: {_TYPE_HINTS[kind]} (got {type(err.get('input')).__name__})"
    if kind in ("model_type", "model_attributes_type"):
        return (f"{path}={_shown(err.get('input'))}: must be a section of fields, e.g. {loc[-1] if loc else path}: "
                f"{{...}}{_suggest(loc + [''], fields_only=True)}")
    if kind == "dict_type":
        return f"{path}={_shown(err.get('input'))}: must be a mapping, e.g. {loc[-1] if loc else path}: {{key: value}}"
    if kind == "string_pattern_mismatch" and path in _FIELD_HINTS:
        return f"{path}={_shown(err.get('input'))}: {_FIELD_HINTS[path]}"
    if kind in _BOUNDS:
        bounds = {**_field_bounds(loc), **(err.get("ctx") or {})}
        msg = _out_of_range(path, kind, {k: int(v) if isinstance(v, float) and v.is_integer() else v
                                         for k, v in bounds.items()})
    msg = msg.removeprefix("Value error, ")
    if kind == "literal_error":
        msg = msg.replace("Input should be", "must be")
    value = err.get("input")
    if isinstance(value, (dict, list)) or value is None:
        return f"{path}: {msg}"
    return f"{path}={_shown(value)}: {msg}"


def _shown(value: Any) -> str:
    """``value`` as an error line repeats it: cut to MAX_SHOWN characters (its length said)."""
    text = str(value)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}... ({len(text)} characters)"


_TYPE_HINTS = {
    "int_type": "must be a whole number such as 10, without quotes, a decimal point or true/false",
    "float_type": "must be a number such as 0.5, without quotes or true/false",
    "bool_type": "must be true or false",
    "string_type": "must be text; quote it",
    "finite_number": "must be a finite number (inf and nan are never valid settings); give a number",
    "tuple_type": "must be a list such as [0.9, 0.95]",
    "list_type": "must be a list such as [a, b]",
}

_FIELD_HINTS = {
    "name": "must be 1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit (it names "
            "the job's checkpoint directory and its Ray actors)",
    "checkpoint.resume": "must be latest, none, a step number such as 40, or the path of a step directory",
}
"""What a field takes, where the general hint for its type would mislead."""


_BOUNDS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le",
           "multiple_of": "multiple_of"}
_SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_WORDS = {"gt": "more than {}", "ge": "{} or more", "lt": "less than {}", "le": "{} or less"}


def _out_of_range(path: str, kind: str, bounds: dict[str, Any]) -> str:
    """``must be >= 1; set training.steps to 1 or more``: the bound broken, and the field's whole range as the fix."""
    key = _BOUNDS[kind]
    if key == "multiple_of":
        return f"must be a multiple of {bounds[key]}; set {path} to a multiple of {bounds[key]}"
    low = next((k for k in ("ge", "gt") if k in bounds), None)
    high = next((k for k in ("le", "lt") if k in bounds), None)
    if (low, high) == ("ge", "le"):
        fix = f"a value from {bounds['ge']} to {bounds['le']}"
    else:
        fix = " and ".join(_WORDS[k].format(bounds[k]) for k in (low, high) if k is not None)
    return f"must be {_SYMBOLS[key]} {bounds[key]}; set {path} to {fix}"


def _field_bounds(loc: list[str]) -> dict[str, Any]:
    """The numeric bounds (``ge``, ``lt``, ...) declared on the field at ``loc``; empty when it is not found."""
    model: type[BaseModel] | None = JobSpec
    field = None
    for part in loc:
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return {}
        model = next((t for t in (field.annotation, *get_args(field.annotation))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
    if field is None:
        return {}
    return {k: getattr(m, k) for m in field.metadata for k in (*_SYMBOLS, "multiple_of") if hasattr(m, k)}


def _suggest(loc: list[str], fields_only: bool = False) -> str:
    """``; did you mean 'x'? (valid fields: ...)`` for the unknown field at ``loc``; with
    ``fields_only`` just `` (valid fields: ...)`` of the section ``loc[:-1]``."""
    model: type[BaseModel] = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        section = next((t for t in (ann, *get_args(ann)) if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if section is None:  # (a section that may be null is ``Section | None``)
            return ""
        model = section
    names = list(model.model_fields)
    close = [] if fields_only else difflib.get_close_matches(loc[-1], names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{hint} (valid fields: {', '.join(names)})"
