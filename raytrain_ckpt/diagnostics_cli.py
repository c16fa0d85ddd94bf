"""``raytrain-ckpt diagnostics JOB_ROOT``: the hangs a job kept evidence of.

Each hang's folder (``<job root>/diagnostics/attempt-<N>/``, written by ``hang_evidence.py`` before
the hung group was torn down) holds every rank's stacks and ``verdict.txt``: this lists them, one
block per attempt, with the culprit and the files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "folders", "run"]


def add_parser(sub: Any) -> None:
    """Add ``diagnostics`` to the CLI's subparsers."""
    c = sub.add_parser("diagnostics", help="list the stacks and culprit kept for each hang of a job")
    c.add_argument("root", help="the job root (<checkpoint.dir>/<name>) or its diagnostics/ folder")
    c.add_argument("--json", action="store_true", help="print JSON")


def folders(root: Path) -> list[Path]:
    """The attempt folders under ``root`` (a job root or its diagnostics/ folder), oldest attempt first."""
    base = root if root.name == "diagnostics" else root / "diagnostics"
    found = [p for p in base.glob("attempt-*") if p.is_dir() and p.name[8:].isdigit()] if base.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[8:]))


def run(args: argparse.Namespace) -> int:
    """Print each hang's culprit and files; exit 0 (none is fine), 2 when the root is not a directory."""
    root = Path(args.root)
    if not root.is_dir():
        print(f"error: diagnostics {root}: not a directory; give a job root, <checkpoint.dir>/<name>",
              file=sys.stderr)
        return 2
    entries = []
    for folder in folders(root):
        verdict = folder / "verdict.txt"
        lines = verdict.read_text().splitlines() if verdict.is_file() else []
        entries.append({"folder": str(folder), "verdict": lines,
                        "files": sorted(str(p) for p in folder.iterdir() if p.is_file())})
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    for e in entries:
        print(e["folder"])
        for line in e["verdict"]:
            print(f"  {line}")
        for f in e["files"]:
            print(f"  {f}")
    print(f"{len(entries)} hang(s) with diagnostics under {root}")
    return 0
