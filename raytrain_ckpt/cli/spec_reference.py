"""Markdown reference of the job spec, generated from the pydantic models.

README embeds the output between ``<!-- spec-reference:begin -->`` and
``<!-- spec-reference:end -->``; ``raytrain-ckpt schema --format markdown`` prints it and a
unit test fails when README is out of date.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from raytrain_ckpt.spec import JobSpec
from raytrain_ckpt.spec.sections import DEFAULT_RESULTS, RESULTS_ENV, results_dir

__all__ = ["BEGIN", "END", "spec_reference_markdown"]

BEGIN = "<!-- spec-reference:begin -->"
END = "<!-- spec-reference:end -->"


def spec_reference_markdown() -> str:
    """One table per top-level section: field, type, default, meaning."""
    out = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in JobSpec.model_fields.items():
        section = _section_model(field)
        if section is None:
            out.append(_row(name, field))
            continue
        out.append(f"| **`{name}`** | section | | {_cell(field.description)} |")
        for sub, sub_field in section.model_fields.items():
            out.append(_row(f"{name}.{sub}", sub_field))
    return "\n".join(out) + "\n"


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _row(path: str, field: FieldInfo) -> str:
    return f"| `{path}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} | {_cell(field.description)} |"


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(ann))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(ann))
        name = getattr(origin, "__name__", str(origin))
        return args.replace(", ", " or ") if name in ("Union", "UnionType") else f"{name}[{args}]"
    if ann is type(None):
        return "null"
    if isinstance(ann, type) and issubclass(ann, Path):
        return "path"
    return getattr(ann, "__name__", str(ann))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is results_dir:  # this machine's home directory is no default to print
        return f"`${RESULTS_ENV}`, else `{DEFAULT_RESULTS}`"
    value = field.default_factory() if field.default is PydanticUndefined else field.default  # type: ignore[misc]
    if isinstance(value, Path):
        return f"`{value}`"
    if isinstance(value, BaseModel):  # a nested section with defaults of its own
        value = value.model_dump(mode="json")
    return f"`{json.dumps(value if not isinstance(value, tuple) else list(value))}`"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")
