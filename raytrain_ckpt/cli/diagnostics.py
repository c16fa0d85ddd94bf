"""``raytrain-ckpt diagnostics JOB_ROOT``: the hangs and failures a job kept evidence of.

A failed attempt's folder holds ``failure.txt``: every failed rank's headline and full text (the
log shows the first rank's and one line per other rank). Each hang's folder (``<job root>/diagnostics/attempt-<N>/``, written by ``control/hang_evidence.py`` before
the hung group was torn down) holds every rank's stacks and ``verdict.txt``: this lists them, one
block per attempt, with the culprit and the files.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from raytrain_ckpt.control.watch.hangs import FAILURE_FILE

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


MAX_VERDICT_BYTES = 1 << 20
"""Most of a ``verdict.txt`` shown (a real one is a few hundred bytes)."""


def _verdict_lines(path: Path) -> list[str]:
    """The lines of a hang's verdict: a regular file only (never a FIFO or a link), at most
    ``MAX_VERDICT_BYTES`` read, bytes that are not UTF-8 shown escaped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return [f"({path.name} is not a regular file; not read)"]
        data = f.read(MAX_VERDICT_BYTES + 1)
    lines = data[:MAX_VERDICT_BYTES].decode("utf-8", errors="backslashreplace").splitlines()
    if len(data) > MAX_VERDICT_BYTES:
        lines.append(f"({path.name} is over {MAX_VERDICT_BYTES} bytes; the rest is not shown)")
    return lines


def run(args: argparse.Namespace) -> int:
    """Print each hang's culprit and files; exit 0 (none is fine), 2 when the root is not a directory
    or cannot be read."""
    root = Path(args.root)
    if not root.is_dir():
        print(f"error: diagnostics {root}: not a directory; give a job root, <checkpoint.dir>/<name>",
              file=sys.stderr)
        return 2
    try:
        entries = _entries(root)
    except OSError as exc:  # a root or folder that cannot be read (no permission): one line, not a traceback
        from raytrain_ckpt.cli import os_error_exit

        code, line = os_error_exit(exc, root)
        print(f"error: diagnostics {line}", file=sys.stderr)
        return code
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    for e in entries:
        print(e["folder"])
        for line in e["verdict"] + e["failures"]:
            print(f"  {line}")
        for f in e["files"]:
            print(f"  {f}")
    failed = sum(bool(e["failures"]) for e in entries)
    print(f"{sum(bool(e['verdict']) for e in entries)} hang(s) with diagnostics under {root}"
          + (f"; {failed} attempt(s) with every failed rank's text ({FAILURE_FILE})" if failed else ""))
    return 0


def _entries(root: Path) -> list[dict[str, Any]]:
    """Each attempt folder's verdict, failed ranks' headlines and files."""
    entries = []
    for folder in folders(root):
        lines = _verdict_lines(folder / "verdict.txt")
        failed = [line for line in _verdict_lines(folder / FAILURE_FILE) if line.startswith("attempt ")]
        entries.append({"folder": str(folder), "verdict": lines, "failures": failed,
                        "files": sorted(str(p) for p in folder.iterdir() if p.is_file())})
    return entries
