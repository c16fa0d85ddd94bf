"""``raytrain-ckpt status | ls | verify``: checkpoint progress of a running job or of a directory.

``status --job NAME`` asks the job's live CheckpointActor (named ``rtc-ckpt-<job>`` in the
``raytrain_ckpt`` Ray namespace); ``status DIR`` and ``ls DIR`` read the manifests on disk;
``verify DIR/step-N`` checks every file's size and checksum. DIR may be an object-store URI
(``s3://bucket/prefix/<job>``; credentials and endpoint from the environment, as boto reads
them, e.g. ``AWS_ENDPOINT_URL``). Exit codes: 0 fine, 1 ``verify``
found the step torn or corrupt, 2 a user mistake (a missing path, no such job, a bad flag).

The command line over ``report/inventory.py`` (the API half, which imports nothing of this).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from typing import Any

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, StepUnreadable, StorageUnavailable
from raytrain_ckpt.checkpoint.format.manifest import MANIFEST
from raytrain_ckpt.checkpoint.format.names import Location, parse_entry
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.format.verify import read_manifest
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from raytrain_ckpt.checkpoint.storage.objects import object_store_problem
from raytrain_ckpt.report.inventory import StepRow, UsageError, format_cell, job_roots_hint, location, progress_bar, root_dir, scan, status_report, verify_step
from raytrain_ckpt.checkpoint.errors import ExitCode
from raytrain_ckpt.cli import os_error_exit

__all__ = ["add_parsers", "run", "strict_json"]


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def strict_json(data: Any) -> str:
    """``--json`` output: strict JSON (a non-finite number is null, never a bare ``NaN``), and
    anything else JSON has no type for as its string."""
    return json.dumps(_finite(data), indent=1, default=str, allow_nan=False)


MAX_WATCH_S = 86400
"""The longest ``--watch`` period: a refresh a day apart is no longer watching."""


def _positive_seconds(text: str) -> float:
    """argparse type of ``--watch``: a refresh period > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value > MAX_WATCH_S:  # (nan fails the first; time.sleep overflows near 1e10)
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds > 0 and at most {MAX_WATCH_S} "
                                         "(a day), e.g. 2")
    return value


def add_parsers(sub: Any) -> None:
    """Add ``status``, ``ls`` and ``verify`` to the CLI's subparsers."""
    st = sub.add_parser("status", help="checkpoint progress of a running job (--job) or a checkpoint directory")
    st.add_argument("dir", nargs="?", help="a job's checkpoint root (checkpoint.dir/<job name>)")
    st.add_argument("--job", help="name of a running job: ask its CheckpointActor")
    st.add_argument("--address", help="Ray cluster for --job: a dashboard URL (http://host:8265), a GCS address "
                                      "(host:6379) or auto; default: RAY_ADDRESS, else the cluster the job's record "
                                      "on this machine names, else auto")
    st.add_argument("--watch", type=_positive_seconds, nargs="?", const=2.0, metavar="SECONDS",
                    help="refresh every SECONDS (default 2) until Ctrl-C")
    st.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    st.add_argument("--checksum", action="store_true", help="with a directory: also check every file's checksum")
    ls = sub.add_parser("ls", help="list the steps of a checkpoint directory with their status")
    ls.add_argument("dir", help="a job's checkpoint root (checkpoint.dir/<job name>)")
    ls.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    ls.add_argument("--checksum", action="store_true", help="also check every file's checksum (reads every file)")
    v = sub.add_parser("verify", help="check every file of a step against its manifest (size and checksum)")
    v.add_argument("step_dir", help="a step directory, e.g. checkpoints/llama-debug-fsdp/step-00000040")
    v.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def run(args: argparse.Namespace, refreshes: int | None = None) -> int:
    """Run ``status``, ``ls`` or ``verify``; user mistakes print one line and return 2."""
    try:
        _check_reachable(args.step_dir if args.command == "verify" else args.dir)
        if args.command == "verify":
            return _verify(location(args.step_dir), args.json)
        if args.command == "ls":
            rows = scan(root_dir(args.dir), "checksum" if args.checksum else "size")
            hint = None if rows else job_roots_hint(root_dir(args.dir))
            if hint:
                print(f"note: {hint}", file=sys.stderr)
            print(strict_json([asdict(r) for r in rows]) if args.json else
                  "\n".join(f"{r.name:<34} {r.status:<11} {format_cell(r.bytes, 'bytes'):>10} {_eval_text(r):>12}  {r.detail}"
                            for r in rows))
            return ExitCode.OK
        if args.job is not None and args.dir is not None:  # (api.status says the same)
            raise UsageError("status: give either a checkpoint directory or --job, not both")
        return _status(args, refreshes)
    except (UsageError, StorageUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except OSError as exc:  # a path that cannot be read: one line, not a traceback; exit 2 when it is the user's to fix
        code, line = os_error_exit(exc, args.step_dir if args.command == "verify" else args.dir)
        print(f"error: {args.command}: {line}", file=sys.stderr)
        return code


def _check_reachable(target: str | None) -> None:
    """An object-store target must answer first: a wrong endpoint or missing credentials is a
    user mistake (one line, exit 2) found in seconds, not a traceback after the client's retries."""
    if target is not None and is_uri(target):
        problem = object_store_problem(target.rstrip("/"), {})
        if problem:
            raise UsageError(problem)


def _eval_text(row: StepRow) -> str:
    return f"eval {row.eval_loss:.4f}" if row.eval_loss is not None else "eval -"


def _status(args: argparse.Namespace, refreshes: int | None) -> int:
    """One report, or (``--watch``) one every period until Ctrl-C or, for a job, until it ended
    or its cluster is gone: then its final state is the last report."""
    n, view = 0, None
    while True:
        if args.job is not None:
            from raytrain_ckpt.report.jobstatus import job_report, job_status

            view = job_status(args.job, args.address, last=view)
            text, data = job_report(view)
        else:
            text, data = status_report(args.dir, "checksum" if args.checksum else "size")
        if args.watch is not None and sys.stdout.isatty():
            print("\x1b[2J\x1b[H", end="")  # clear the terminal: a refreshing view, not a scrolling log
        print(strict_json(data) if args.json else text, flush=True)
        n += 1
        if args.watch is None or (refreshes is not None and n >= refreshes):
            return ExitCode.OK
        if view is not None and view.ended:
            if not args.json:
                print(f"job {args.job} ended: {view.state}; watch stopped", flush=True)
            return ExitCode.OK
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return ExitCode.OK


def _verify(path: Location, as_json: bool) -> int:
    storage = open_storage(path)
    if not storage.is_dir(path):
        raise UsageError(f"{path}: no such step directory; pass one like checkpoints/<job>/step-00000040")
    name = storage.name(path)
    if parse_entry(name) is None:
        raise UsageError(f"{path}: not a step directory (expected a name like step-00000040)")
    total = _manifest_bytes(path)
    bar = progress_bar(total, f"verify {name}")
    try:
        problems = verify_step(path, bar.update if bar else lambda n: None)
    finally:
        if bar:
            bar.close()
    status = "valid" if not problems else ("torn" if not storage.is_file(storage.join(path, MANIFEST)) else "corrupt")
    if as_json:
        print(strict_json({"path": str(path), "status": status, "problems": problems}))
    else:
        print(f"{path}: {status.upper()}" + ("" if problems else f" (every file's size and checksum match, "
                                                                  f"{total / 1e6:.1f} MB)"))
        for p in problems:
            print(f"  {p}")
    return ExitCode.OK if not problems else ExitCode.FAILED


def _manifest_bytes(path: Location) -> int:
    try:
        return read_manifest(open_storage(path), path).total_bytes
    except StepUnreadable as exc:  # this user's access, not the step: a usage error, as for its other files
        raise UsageError(str(exc)) from None
    except InvalidCheckpoint:
        return 0
