"""A FIFO (or another special file) inside a token, text or prepare-data input directory is
refused by name with one line, never opened: reading a FIFO blocks until someone writes to it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _no_hang():
    """On the old code these tests block in open(); an alarm turns that into a failure."""
    import signal

    def hung(*_):
        raise TimeoutError("blocked reading a FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def fifo_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    np.arange(100, dtype=np.uint16).tofile(d / "000-a.bin")
    (d / "a.txt").write_text("hello world\n")
    return d


def test_a_fifo_shard_in_a_token_directory_is_refused(fifo_dir: Path):
    from raytrain_ckpt.data.tokens import TokenCorpus

    os.mkfifo(fifo_dir / "001-b.npy")
    with pytest.raises(ValueError, match="001-b.npy is not a regular file"):
        TokenCorpus(fifo_dir, "uint16", 256)


def test_a_fifo_shard_that_meta_json_lists_is_refused(fifo_dir: Path):
    from raytrain_ckpt.data.tokens import TokenCorpus

    os.mkfifo(fifo_dir / "001-b.npy")
    (fifo_dir / "meta.json").write_text(json.dumps({"dtype": "uint16", "shards": {"000-a.bin": 100, "001-b.npy": 5}}))
    with pytest.raises(ValueError, match="is not a regular file"):
        TokenCorpus(fifo_dir, "uint16", 256)


def test_a_fifo_in_a_text_directory_is_refused_by_validate(fifo_dir: Path, capsys):
    from raytrain_ckpt.cli.main import main

    os.mkfifo(fifo_dir / "b.md")
    spec = fifo_dir.parent / "spec.yaml"
    spec.write_text(f"name: x\ndata:\n  source: text\n  path: {fifo_dir}\n")
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "b.md is not a regular file" in err


def test_a_fifo_among_prepare_data_inputs_is_refused(fifo_dir: Path, capsys):
    from raytrain_ckpt.cli.main import main

    os.mkfifo(fifo_dir / "c.jsonl")
    assert main(["prepare-data", str(fifo_dir), "--out", str(fifo_dir.parent / "out"), "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert "c.jsonl is not a regular file" in err and "Traceback" not in err


def test_an_input_directory_that_cannot_be_listed_is_named_not_silently_empty(tmp_path: Path) -> None:
    """A directory below the input (or the input itself) that cannot be listed dropped its files
    without a word: ``prepare-data`` then said "no input files", and a text source trained on the
    rest. It is refused by name. Root lists any directory, so as root the listing runs as another
    user (``nobody``), on a copy of the torch-free module where that user can read it."""
    import shutil
    import subprocess
    import tempfile

    from raytrain_ckpt.data import suffixes

    base = Path(tempfile.mkdtemp(prefix="rtc-unlistable-"))
    try:
        base.chmod(0o755)
        top = base / "in"
        (top / "locked").mkdir(parents=True)
        (top / "a.txt").write_text("seen\n")
        (top / "locked" / "b.txt").write_text("dropped before\n")
        top.chmod(0o755)
        (top / "a.txt").chmod(0o644)
        (top / "locked").chmod(0o000)
        if os.geteuid() != 0:
            with pytest.raises(ValueError) as exc:
                suffixes.input_files(top, {".txt"})
            message = str(exc.value)
        else:
            shutil.copyfile(suffixes.__file__, base / "suffixes.py")
            (base / "suffixes.py").chmod(0o644)
            code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import suffixes\n"
                    "try:\n    suffixes.input_files(Path(sys.argv[2]), {'.txt'})\nexcept ValueError as e:\n"
                    "    print(e); sys.exit(3)\n")
            out = subprocess.run(["/usr/bin/python3", "-I", "-c", code, str(base), str(top)], user=65534, cwd="/", capture_output=True,
                                 text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
            assert out.returncode == 3, (out.stdout, out.stderr)
            message = out.stdout.strip()
        assert message == f"{top / 'locked'}: cannot be listed (Permission denied); fix its permissions or leave it out"
    finally:
        (base / "in" / "locked").chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_a_fifo_given_as_the_input_itself_is_named_as_one(tmp_path: Path) -> None:
    """A FIFO passed as ``prepare-data``'s input (not inside a directory) is said to be no regular
    file, not a directory whose permissions to fix."""
    from raytrain_ckpt.cli.prepare import PrepareError, prepare_data
    from raytrain_ckpt.data.suffixes import NOT_REGULAR

    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(PrepareError) as exc:
        prepare_data([fifo], tmp_path / "out", vocab_size=300, progress=False)
    assert str(exc.value) == f"{fifo} {NOT_REGULAR}; give a file or a directory"
    assert not (tmp_path / "out").exists()
