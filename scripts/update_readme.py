"""Regenerate README's job spec reference: python scripts/update_readme.py [--check]."""

from __future__ import annotations

import sys
from pathlib import Path

from raytrain_ckpt.cli.spec_reference import BEGIN, END, spec_reference_markdown

README = Path(__file__).resolve().parent.parent / "README.md"


def render(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{spec_reference_markdown()}{END}{tail}"


if __name__ == "__main__":
    current = README.read_text(encoding="utf-8")
    wanted = render(current)
    if "--check" in sys.argv[1:]:
        sys.exit(0 if current == wanted else "README spec reference is stale: run python scripts/update_readme.py")
    README.write_text(wanted, encoding="utf-8")
