"""``raytrain-ckpt clean-buffers``: remove staging buffers whose owning writer is dead.

The same sweep a CheckpointWriter runs when it starts (``checkpoint/datapath/buffers.py``), for a node
where no job will run again soon: a killed driver's buffers otherwise hold RAM in /dev/shm.
Buffers whose writer is alive are never touched.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from raytrain_ckpt.checkpoint.datapath.buffers import shm_dir, sweep_orphans
from raytrain_ckpt.checkpoint.errors import ExitCode
from raytrain_ckpt.cli import os_error_exit

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``clean-buffers`` to the CLI's subparsers."""
    c = sub.add_parser("clean-buffers", help="remove /dev/shm staging buffers left by dead jobs (this user's)")
    c.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    c.add_argument("--dir", default=None, help=f"where the buffers are (default: {shm_dir()})")


def run(args: argparse.Namespace) -> int:
    """Sweep, print one line per buffer and a total; exit 0 (nothing to remove is fine), 2 for a bad --dir."""
    if args.dir is not None and not args.dir.strip():  # never the default: an unset variable, not a choice
        print(f"error: clean-buffers --dir {args.dir!r}: empty; give the directory the staging buffers are in, "
              f"or leave --dir out for the default ({shm_dir()})", file=sys.stderr)
        return ExitCode.USAGE
    directory = Path(args.dir) if args.dir is not None else shm_dir()
    if not directory.is_dir():
        print(f"error: clean-buffers --dir {directory}: not a directory; give the directory the staging "
              "buffers are in (default: /dev/shm)", file=sys.stderr)
        return ExitCode.USAGE
    try:
        os.listdir(directory)  # (the sweep's glob would take an unreadable directory for an empty one)
    except OSError as exc:
        code, line = os_error_exit(exc, directory)
        print(f"error: clean-buffers --dir {line}", file=sys.stderr)
        return code
    removed = sweep_orphans(directory, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for o in removed:
        print(f"{verb} {o.path} ({_mb(o.nbytes)})")
    print(f"{verb} {len(removed)} orphaned staging buffer(s) in {directory}, {_mb(sum(o.nbytes for o in removed))}")
    return ExitCode.OK


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"
