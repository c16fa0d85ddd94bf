"""scripts/file_seconds.py: a test file's seconds are the sum of its tests' phases in a
``--durations=0`` log, longest file first; other lines are ignored."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("file_seconds", REPO / "scripts" / "file_seconds.py")
file_seconds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(file_seconds)

LOG = """\
tests/unit/test_a.py::test_x PASSED [ 10%]
============================= slowest durations ==============================
12.50s call     tests/integration/test_b.py::test_one[exit-1]
3.00s setup    tests/integration/test_b.py::test_one[exit-1]
0.40s teardown tests/integration/test_b.py::test_two
2.20s call     tests/unit/test_a.py::test_x
(14 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_a_files_seconds_add_up_its_phases_longest_first():
    seconds = file_seconds.file_seconds(LOG.splitlines())
    assert seconds == {"tests/integration/test_b.py": 15.9, "tests/unit/test_a.py": 2.2}
    assert list(seconds) == ["tests/integration/test_b.py", "tests/unit/test_a.py"]


def test_a_log_without_durations_is_a_one_line_error(tmp_path):
    log = tmp_path / "log"
    log.write_text("tests/unit/test_a.py::test_x PASSED\n")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "file_seconds.py"), str(log)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no --durations lines" in out.stderr and "Traceback" not in out.stderr


def test_the_recorded_seconds_are_a_flat_table_of_test_files():
    seconds = json.loads((REPO / "tests" / "file_seconds.json").read_text())
    assert seconds and all(k.startswith("tests/") and k.endswith(".py") and v >= 0 for k, v in seconds.items())
