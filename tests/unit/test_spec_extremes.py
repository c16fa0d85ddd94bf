"""``validate`` of every job spec field at its extremes exits 0 or 2, never 1, never a traceback.

Every leaf field of ``JobSpec`` is enumerated from the pydantic models (a new field is covered
without editing this file) and set with ``--set`` to huge and negative integers (thousands of
digits too), tiny, subnormal and non-finite floats, long and odd strings (a NUL, a line
separator), a symbolic link loop and paths under /proc. A value that fails prints ``error:``
lines only; one that passes prints strict JSON.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from raytrain_ckpt.cli.main import main
from raytrain_ckpt.spec import JobSpec


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        section = next((t for t in (ann, *typing.get_args(ann)) if isinstance(t, type) and issubclass(t, BaseModel)),
                       None)
        out += _leaves(section, f"{prefix}{name}.") if section is not None else [f"{prefix}{name}"]
    return out


FIELDS = _leaves(JobSpec)

EXTREMES = [
    "9" * 5000, "-" + "9" * 5000, str(2**64), str(2**63), str(-2**63 - 1), "0", "-1", "1_000", "0x10",
    "1e308", "1e400", "-1e400", "5e-324", "1e-320", "1e-30", "0.00001", "0.00015", "1.5", ".nan", ".inf", "-.inf",
    "100000000000000000000.5", "a" * 10_000, '"a\\0b"', '"\\0"', '"\\u2028"', '"\\ud800\\udc00"', "''", "'   '", "[]", "{}", "null",
    "true", "~nouser/x", "s3://user:secret@bucket/x", "/dev/null", "/dev/zero/x", "é" * 300, "{loop}", "{loop}/x",
    "/proc/self/x", "/proc/1/ckpt", "/sys/x",
]


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("extremes")
    loop = tmp / "loop"
    os.symlink(loop, loop)
    path = tmp / "spec.yaml"
    path.write_text("name: extremes\nmodel:\n  name: debug\n")
    return path, loop


def _validate(spec: Path, setting: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["validate", str(spec), "--format", "json", "--set", setting])
    text = err.getvalue()
    assert code in (0, 2), (setting[:80], code, text[-500:])
    assert "Traceback" not in text, (setting[:80], text[-2000:])
    if code == 2:
        lines = text.splitlines()
        assert lines and all(line.startswith("error: ") for line in lines), (setting[:80], text[-500:])
        assert "secret" not in text, text
    else:
        json.loads(out.getvalue(), parse_constant=lambda c: pytest.fail(f"{setting[:80]}: {c} in JSON output"))


def test_every_field_is_enumerated():
    assert len(FIELDS) > 60 and "checkpoint.replication.max_mb_per_s" in FIELDS and "eval.every_steps" in FIELDS


@pytest.mark.parametrize("field", FIELDS)
def test_validate_of_a_field_at_its_extremes_exits_0_or_2(spec_file, field: str):
    spec, loop = spec_file
    for value in EXTREMES:
        _validate(spec, f"{field}={value.replace('{loop}', str(loop))}")


_text = st.text(st.characters(codec="utf-8"), max_size=40).map(json.dumps)  # as YAML: a quoted string
_numbers = st.one_of(st.integers(min_value=-(2**70), max_value=2**70).map(str),
                     st.floats(allow_nan=True, allow_infinity=True).map(repr).map(
                         lambda r: {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}.get(r, r)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=st.one_of(_numbers, _text))
def test_validate_of_any_field_at_any_value_exits_0_or_2(spec_file, field: str, value: str):
    _validate(spec_file[0], f"{field}={value}")


@pytest.mark.parametrize(("setting", "expected"), [
    ("resources.cpus_per_worker=0.00015", "finer than Ray's resource granularity 0.0001"),
    ("resources.cpus_per_worker=1e-30", "finer than Ray's resource granularity 0.0001"),
    ("training.steps=18446744073709551616", "beyond 64 bits"),
    (f"training.steps={'9' * 5000}", "a number too long to read"),
    ("optimizer.lr=5e-324", "is subnormal"),
    ("fault_tolerance.hang_timeout_s=1e-30", "below 0.001 s"),
    ("checkpoint.replication.max_mb_per_s=1e-30", "below 0.001 MB/s"),
    ('checkpoint.dir="a\\0b"', "contains a NUL byte"),
    ("checkpoint.final_export.dir='  '", "is empty"),
    ("checkpoint.resume=''", "must be latest, none"),
    ("checkpoint.resume='99999999999999999999999'", "beyond any step"),
    ("checkpoint.dir={loop}/x", "a symbolic link loop"),
    ('model.name="\\ud800\\udc00"', "holds a lone surrogate"),
])
def test_values_the_run_could_not_use_are_refused(spec_file, capsys, setting: str, expected: str):
    """Each of these validated before and then failed (or overflowed) at run time."""
    spec, loop = spec_file
    assert main(["validate", str(spec), "--set", setting.replace("{loop}", str(loop))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err


def test_gpus_above_one_must_be_whole(spec_file, capsys):
    spec, _ = spec_file
    assert main(["validate", str(spec), "--set", "resources.use_gpu=true", "--set", "resources.gpus_per_worker=1.5"]) == 2
    assert "only in whole GPUs" in capsys.readouterr().err


def test_an_error_line_shows_a_long_value_cut_and_escapes_a_line_separator(spec_file, capsys):
    spec, _ = spec_file
    assert main(["validate", str(spec), "--set", f'name="a\\u2028{"x" * 500}"']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\\u2028" in err and "(502 characters)" in err and len(err) < 600


def test_a_secret_in_a_uri_is_masked_in_the_error_line(spec_file, capsys):
    spec, _ = spec_file
    assert main(["validate", str(spec), "--set", "checkpoint.dir=nosuch://user:hunter2@bucket/x"]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "user:***@bucket" in err
