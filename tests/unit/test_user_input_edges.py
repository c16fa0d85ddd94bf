"""Each way a user's input reached a traceback, a hang or a later failure, refused where it enters
with one ``error:`` line (exit 2) naming the file or field and the fix: a FIFO in an imported
HF directory, one tensor in two imported files, a damaged token ``meta.json``, malformed JSONL
lines, ``!!binary`` values, a checkpoint.dir under /proc, a split point of 5,000 digits, an
export inside the checkpoint root, a ``--watch`` period of centuries."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DIGITS = "9" * 5000


@pytest.fixture(autouse=True)
def _no_hang():
    """Reading a FIFO blocks until someone writes to it: an alarm turns that into a failure."""
    def hung(*_):
        raise TimeoutError("blocked reading a FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _main(argv: list[str], capsys) -> tuple[int, str]:
    from raytrain_ckpt.cli.main import main

    rc = main(argv)
    err = capsys.readouterr().err
    return rc, err


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- import ---------------------------------------------------------------------------------------

def _hf_dir(path: Path, **files: dict) -> Path:
    import torch
    from safetensors.torch import save_file

    path.mkdir()
    for name, tensors in files.items():
        save_file({k: torch.full((2, 2), float(v)) for k, v in tensors.items()}, str(path / f"{name}.safetensors"))
    return path


def test_a_fifo_in_an_hf_directory_is_refused_by_name(tmp_path: Path, capsys):
    hf = _hf_dir(tmp_path / "hf", a={"model.embed_tokens.weight": 0})
    os.mkfifo(hf / "b.safetensors")
    # A subprocess: the open that blocks is in safetensors' Rust code, which no Python signal handler interrupts.
    proc = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "import", str(hf), "--to", str(tmp_path / "ck")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "b.safetensors is not a regular file" in _one_error(proc.stderr)
    assert not (tmp_path / "ck" / "step-00000000").exists()


def test_one_tensor_in_two_imported_files_names_both(tmp_path: Path, capsys):
    hf = _hf_dir(tmp_path / "hf", a={"model.embed_tokens.weight": 0}, b={"model.embed_tokens.weight": 1})
    rc, err = _main(["import", str(hf), "--to", str(tmp_path / "ck")], capsys)
    assert rc == 2
    line = _one_error(err)
    assert "defined twice" in line and "a.safetensors" in line and "b.safetensors" in line
    assert not (tmp_path / "ck" / "step-00000000").exists()


# --- validate: a token corpus's meta.json -----------------------------------------------------------

@pytest.mark.parametrize("meta", [
    '{"vocab_size": [1], "dtype": "uint16"}',
    '{"vocab_size": 1e400}',
    '{"dtype": ["uint16"]}',
    '{"dtype": {"a": 1}}',
    '{"vocab_size": true}',
    "[" * 100_000 + "]" * 100_000,
], ids=["list-vocab", "inf-vocab", "list-dtype", "dict-dtype", "bool-vocab", "deep"])
def test_a_damaged_token_meta_json_is_one_line(tmp_path: Path, capsys, meta: str):
    corpus = tmp_path / "tokens"
    shutil.copytree(REPO / "data" / "tokens-docs", corpus)
    (corpus / "meta.json").write_text(meta)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: t\nmodel: {{name: debug, overrides: {{vocab_size: 512}}}}\n"
                    f"data: {{source: tokens, path: {corpus}, dtype: uint16}}\ncheckpoint: {{dir: {tmp_path / 'ck'}}}\n")
    rc, err = _main(["validate", str(spec)], capsys)
    assert rc == 2
    line = _one_error(err)
    assert line.startswith("error: data.path:") and "meta.json" in line and "prepare-data" in line


# --- prepare-data: malformed JSONL lines -----------------------------------------------------------

@pytest.mark.parametrize("line,said", [
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    (f'{{"text": "x", "n": {DIGITS}}}', "number too long"),
    ('{"text": "\\ud800 half a character"}', "lone surrogate"),
], ids=["deep", "digits", "surrogate"])
def test_a_malformed_jsonl_line_is_one_line_naming_it(tmp_path: Path, capsys, line: str, said: str):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "hello world"}\n' + line + "\n")
    rc, err = _main(["prepare-data", str(src), "--out", str(tmp_path / "out"), "--vocab-size", "300",
                     "--workers", "1"], capsys)
    assert rc == 2
    shown = _one_error(err)
    assert "a.jsonl:2:" in shown and said in shown


# --- validate: values and paths ----------------------------------------------------------------------

def _validate(tmp_path: Path, capsys, body: str) -> str:
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: t\nmodel: {name: debug}\n" + body + "\n")
    rc, err = _main(["validate", str(spec)], capsys)
    assert rc == 2, err
    return _one_error(err)


@pytest.mark.parametrize("body,field", [
    ("checkpoint: {dir: /tmp/x, storage_options: {key: !!binary aGVsbG8=}}", "checkpoint.storage_options.key"),
    ("data: {source: text, path: !!binary aGVsbG8=}", "data.path"),
])
def test_a_binary_yaml_value_is_refused_by_its_field(tmp_path: Path, capsys, body: str, field: str):
    line = _validate(tmp_path, capsys, body)
    assert line.startswith(f"error: {field}:") and "!!binary" in line


@pytest.mark.parametrize("where", ["/proc", "/sys/fs/ckpt"])
def test_a_checkpoint_dir_under_the_kernels_views_is_refused(tmp_path: Path, capsys, where: str):
    line = _validate(tmp_path, capsys, f"checkpoint: {{dir: {where}}}")
    assert line.startswith(f"error: checkpoint.dir={where}:") and "point it at a writable directory" in line


def test_a_split_point_of_5000_digits_names_the_field(tmp_path: Path, capsys):
    line = _validate(tmp_path, capsys, f"parallelism: {{pp: 2, pp_split_points: [layers.{DIGITS}]}}")
    assert line.startswith("error: parallelism.pp_split_points:") and "layers.<i>" in line
    assert len(line) < 300


@pytest.mark.parametrize("export", ["ck/t/exported", "ck/t", "ck"])
def test_an_export_dir_overlapping_the_checkpoint_root_is_refused(tmp_path: Path, capsys, export: str):
    line = _validate(tmp_path, capsys, f"checkpoint: {{dir: {tmp_path / 'ck'}, final_export: "
                                       f"{{format: torch, dir: {tmp_path / export}}}}}")
    assert line.startswith("error: checkpoint.final_export.dir=") and "checkpoint root" in line


def test_an_export_dir_beside_the_root_is_accepted(tmp_path: Path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: t\nmodel: {{name: debug}}\ncheckpoint: {{dir: {tmp_path / 'ck'}, final_export: "
                    f"{{format: torch, dir: {tmp_path / 'ck' / 'exports-of-t'}}}}}\n")
    rc, err = _main(["validate", str(spec)], capsys)
    assert rc == 0, err


@pytest.mark.parametrize("period", ["1e10", "86401"])
def test_a_watch_period_past_a_day_is_refused_at_parsing(tmp_path: Path, capsys, period: str):
    with pytest.raises(SystemExit) as stop:
        _main(["status", str(tmp_path / "missing"), "--watch", period], capsys)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --watch: {period} must be a number of seconds > 0 and at most 86400" in err
