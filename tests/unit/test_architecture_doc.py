"""docs/ARCHITECTURE.md's module table names every module of the package, and only modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "raytrain_ckpt"


def table_entries(markdown: str) -> set[str]:
    """The first cell (`path` or `package/`) of each row of the "## Modules" table."""
    section = markdown.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w/.]+)` \|", section, flags=re.MULTILINE))


def undocumented(entries: set[str], modules: list[str]) -> list[str]:
    """Modules (paths relative to the package) that no row covers: by name, or by their package's row."""
    return [m for m in modules if m not in entries and not any(m.startswith(e) for e in entries if e.endswith("/"))]


def _modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                  if p.name not in ("__init__.py", "__main__.py"))


def test_the_checks_see_a_missing_and_a_covered_module():
    entries = table_entries("x\n## Modules\n\n| module | concept |\n| --- | --- |\n| `a.py` | A |\n| `pkg/` | P |\n"
                            "\n## Next\n| `b.py` | not the table |\n")
    assert entries == {"a.py", "pkg/"}
    assert undocumented(entries, ["a.py", "b.py", "pkg/c.py", "other/d.py"]) == ["b.py", "other/d.py"]


def test_the_module_table_is_complete_and_current():
    entries = table_entries((REPO / "docs" / "ARCHITECTURE.md").read_text())
    assert undocumented(entries, _modules()) == [], "add a row to docs/ARCHITECTURE.md's module table"
    stale = sorted(e for e in entries if not (PACKAGE / e).exists())
    assert stale == [], "rows for modules that no longer exist"
