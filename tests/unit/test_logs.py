"""One log format: only ``raytrain_ckpt/common/logs.py`` configures logging or spells a format string."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "raytrain_ckpt"
FORMAT_FIELDS = ("%(asctime)", "%(levelname)", "%(message)", "%(name)")
CONFIGURING = ("basicConfig", "Formatter", "dictConfig", "fileConfig")


def log_setup_sites(source: str) -> list[str]:
    """``line: what`` for every call that configures logging and every log format string in ``source``."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in CONFIGURING:
                out.append((node.lineno, f"calls {name}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if any(field in node.value for field in FORMAT_FIELDS):
                out.append((node.lineno, f"log format {node.value!r}"))
    return [f"{line}: {what}" for line, what in sorted(out)]


def test_the_detector_sees_each_way_of_setting_a_format():
    source = ('import logging\nfrom logging import basicConfig\nlogging.basicConfig(level=20)\n'
              'basicConfig()\nh.setFormatter(logging.Formatter("%(message)s"))\nFMT = "%(levelname)s x"\n'
              'logger.info("%s -> %s (%s)", a, b, c)\n')
    assert log_setup_sites(source) == ["3: calls basicConfig", "4: calls basicConfig", "5: calls Formatter",
                                       "5: log format '%(message)s'", "6: log format '%(levelname)s x'"]


def test_only_logs_py_configures_logging():
    found = {str(path.relative_to(PACKAGE.parent)): sites for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "logs.py" or path.parent != PACKAGE / "common"
             if (sites := log_setup_sites(path.read_text()))}
    assert found == {}, "use raytrain_ckpt.common.logs.setup_logging() instead: " + repr(found)
    assert log_setup_sites((PACKAGE / "common/logs.py").read_text())  # the one place does configure it
