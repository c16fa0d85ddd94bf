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
