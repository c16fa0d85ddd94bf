"""checkpoint/errors.py is the one home of the checkpoint package's errors, and each crosses a process."""

from __future__ import annotations

import ast
import inspect
import pickle
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint import errors

PACKAGE = Path(__file__).resolve().parents[2] / "raytrain_ckpt"
ERRORS = [obj for _, obj in inspect.getmembers(errors, inspect.isclass)
          if issubclass(obj, BaseException) and obj.__module__ == errors.__name__]


def exception_classes(root: Path) -> list[str]:
    """``path:Class`` of every class below ``root`` whose bases name an exception type."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(b).endswith(("Error", "Exception", "Checkpoint", "Mismatch", "Aborted", "Unavailable",
                                             "InUse", "NotShared", "Refused", "OwnFile")) for b in node.bases):
                out.append(f"{path.relative_to(root).as_posix()}:{node.name}")
    return out


def test_the_scan_finds_an_exception_class(tmp_path):
    (tmp_path / "m.py").write_text("class A(ValueError):\n    pass\nclass B:\n    pass\n")
    assert exception_classes(tmp_path) == ["m.py:A"]


def test_every_checkpoint_error_is_defined_in_errors_py():
    assert [c for c in exception_classes(PACKAGE / "checkpoint") if not c.startswith("errors.py:")] == []
    assert len(ERRORS) >= 14


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_each_error_pickles_with_its_message(cls):
    exc = cls("step 30: what is wrong; how to fix it")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and str(back) == str(exc)


def test_exit_codes_are_the_documented_ones():
    assert {c.name: int(c) for c in errors.ExitCode} == {"OK": 0, "FAILED": 1, "USAGE": 2, "INTERRUPTED": 130,
                                                          "STOPPED": 143}
    assert all(issubclass(e, Exception) for e in errors.USAGE_ERRORS)
