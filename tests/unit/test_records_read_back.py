"""Records read back from disk are validated by the spec's rules, bounded in size, and name their file.

A manifest's skip windows, a job's ``.job.json`` and a hang's ``verdict.txt`` come from storage that
others may write: a malformed one is refused or ignored with one line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from raytrain_ckpt.cli import diagnostics as diagnostics_cli
from raytrain_ckpt.report import jobrecord
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.manifest import Manifest


def _manifest(windows) -> str:
    return json.dumps({"step": 3, "world_size": 1, "dp_size": 1, "spec_hash": "h", "files": {},
                       "skipped_samples": windows})


@pytest.mark.parametrize("window", [[0, 5000, 16], [0, 7, 7], [0, 0, 10**30], [10**30, 0, 1]])
def test_a_skip_window_outside_the_spec_rules_is_refused(window):
    with pytest.raises(InvalidCheckpoint, match="skip"):
        Manifest.from_json(_manifest([window]))


def test_a_valid_skip_window_is_kept():
    assert Manifest.from_json(_manifest([[4, 16, 5000]])).skipped_samples == [[4, 16, 5000]]


@pytest.mark.parametrize("share", [[0, 1, 0, 8], [3, 1, 8, 8], [3, 1, 9, 8], [3, -1, 0, 8], [3, 1, 0],
                                   [3, 1, 0, 10**30]])
def test_a_replica_skip_outside_the_rules_is_refused(share):
    text = json.dumps({"step": 3, "world_size": 2, "dp_size": 2, "spec_hash": "h", "files": {},
                       "replica_skips": [share]})
    with pytest.raises(InvalidCheckpoint, match="replica_skips"):
        Manifest.from_json(text)


def test_a_valid_replica_skip_is_kept():
    text = json.dumps({"step": 3, "world_size": 2, "dp_size": 2, "spec_hash": "h", "files": {},
                       "replica_skips": [[2, 1, 8, 16]]})
    assert Manifest.from_json(text).replica_skips == [[2, 1, 8, 16]]


@pytest.mark.parametrize("content", [b"[" * 200_000 + b"]" * 200_000,
                                     json.dumps({"committed": "x", "job_info": {"state": 3}}).encode(),
                                     json.dumps({"job_info": [1]}).encode(),
                                     json.dumps({"latest": "7"}).encode(), b"\xff\xfe{"])
def test_a_deep_or_wrongly_typed_job_record_is_ignored_naming_it(tmp_path, caplog, content):
    (tmp_path / jobrecord.RECORD).write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert jobrecord.read_root(str(tmp_path)) is None
    assert str(tmp_path / jobrecord.RECORD) in caplog.text


def test_a_huge_job_record_is_not_read(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(jobrecord, "MAX_RECORD_BYTES", 1000)
    (tmp_path / jobrecord.RECORD).write_bytes(json.dumps({"job": "x" * 2000}).encode())
    with caplog.at_level(logging.WARNING):
        assert jobrecord.read_root(str(tmp_path)) is None
    assert "over" in caplog.text


def test_status_of_a_root_with_a_deep_record_does_not_traceback(tmp_path, capsys):
    from raytrain_ckpt.cli.main import main

    (tmp_path / jobrecord.RECORD).write_bytes(b"{\"a\":" * 200_000 + b"1" + b"}" * 200_000)
    main(["status", str(tmp_path)])
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err


def test_a_verdict_that_is_not_utf8_or_huge_is_shown_bounded(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "diagnostics" / "attempt-1"
    folder.mkdir(parents=True)
    (folder / "verdict.txt").write_bytes(b"culprit: rank 1 \xff\xfe\n")
    assert diagnostics_cli.run(argparse.Namespace(root=str(tmp_path), json=False)) == 0
    assert "culprit: rank 1 \\xff\\xfe" in capsys.readouterr().out
    monkeypatch.setattr(diagnostics_cli, "MAX_VERDICT_BYTES", 64)
    (folder / "verdict.txt").write_bytes(b"x" * 1000)
    assert diagnostics_cli.run(argparse.Namespace(root=str(tmp_path), json=True)) == 0
    shown = json.loads(capsys.readouterr().out)[0]["verdict"]
    assert len(shown[0]) == 64 and "over 64 bytes" in shown[1]


def test_a_verdict_that_is_a_fifo_does_not_block(tmp_path, capsys):
    import os

    folder = tmp_path / "diagnostics" / "attempt-1"
    folder.mkdir(parents=True)
    os.mkfifo(folder / "verdict.txt")
    assert diagnostics_cli.run(argparse.Namespace(root=str(tmp_path), json=False)) == 0
    assert "not a regular file" in capsys.readouterr().out

