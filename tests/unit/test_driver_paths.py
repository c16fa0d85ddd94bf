"""The driver's path for Ray workers: every entry absolute, none empty, each once."""

from __future__ import annotations

import os


def test_the_workers_path_is_the_drivers_with_every_entry_absolute(tmp_path, monkeypatch):
    from raytrain_ckpt.driver import _worker_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["src", "", "/opt/site", str(tmp_path), "src"]))
    # a relative entry means the driver's directory; an empty one (the worker's own cwd) is dropped
    assert _worker_path().split(os.pathsep) == [str(tmp_path), str(tmp_path / "src"), "/opt/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert _worker_path() == str(tmp_path)
