"""``raytrain-ckpt status | ls | verify``: checkpoint progress of a running job or of a directory.

``status --job NAME`` asks the job's live CheckpointActor (named ``rtc-ckpt-<job>`` in the
``raytrain_ckpt`` Ray namespace); ``status DIR`` and ``ls DIR`` read the manifests on disk;
``verify DIR/step-N`` checks every file's size and checksum. DIR may be an object-store URI
(``s3://bucket/prefix/<job>``; credentials and endpoint from the environment, as boto reads
them, e.g. ``AWS_ENDPOINT_URL``). Exit codes: 0 fine, 1 ``verify``
found the step torn or corrupt, 2 a user mistake (a missing path, no such job, a bad flag).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytrain_ckpt.checkpoint.policy.interval import IntervalDecision
from raytrain_ckpt.checkpoint.records import ActorStatus
from raytrain_ckpt.checkpoint.storage.layout import (MANIFEST, CheckpointLayout, EntryKind, InvalidCheckpoint, Verify,
                                             parse_entry, step_name)
from raytrain_ckpt.checkpoint.storage.backends import (Location, StorageUnavailable, home_problem, is_uri, object_store_problem,
                                              parent_of)
from raytrain_ckpt.checkpoint.roles.summary import failed_saves_text, phase_text, summary_line

logger = logging.getLogger(__name__)

__all__ = ["StepRow", "add_parsers", "run", "scan", "verify_step"]

EXIT_OK, EXIT_BAD, EXIT_USAGE = 0, 1, 2
_ASIDE: dict[EntryKind, tuple[str, str]] = {
    EntryKind.TMP: ("torn", "no manifest: being written, or left by a crash"),
    EntryKind.INVALID: ("moved-aside", "an invalid step-N moved aside (a re-save, or skipped on resume)"),
    EntryKind.ABANDONED: ("abandoned", "a step of an abandoned timeline, moved aside; never loaded"),
}


class UsageError(ValueError):
    """A user mistake: printed as one line, exit code 2."""


@dataclass
class StepRow:
    """One line of the status table."""

    step: int
    name: str
    status: str
    """valid, in-flight, torn (never committed), corrupt (fails its manifest), moved-aside, abandoned, aborted."""
    bytes: int | None = None
    save_s: float | None = None
    stall_s: float | None = None
    age_s: float | None = None
    detail: str = ""
    eval_loss: float | None = None
    """Validation loss recorded in the manifest, when an evaluation fell on this step."""


# --- offline: a checkpoint directory -------------------------------------------------------

def scan(root: Location, level: Verify = "size", now: float | None = None) -> list[StepRow]:
    """Every step entry under a job's checkpoint root, with its status (file sizes, or also checksums, checked)."""
    layout, now = CheckpointLayout(root), now or time.time()
    rows = []
    entries = layout.entries()
    bar = _progress_bar(len(entries), "checksum", unit="dir") if level == "checksum" else None
    for entry, path in entries:
        if bar is not None:
            bar.update(1)
        if entry.kind.is_loadable:
            rows.append(_row(layout, path, entry.step, level, now))
        else:
            status, detail = _ASIDE[entry.kind]
            rows.append(StepRow(entry.step, entry.name, status, detail=detail))
    if bar is not None:
        bar.close()
    return rows


def _row(layout: CheckpointLayout, path: Location, step: int, level: Verify, now: float) -> StepRow:
    name = layout.storage.name(path)
    try:
        m = layout.verify(path, level)
    except InvalidCheckpoint as exc:
        status = "torn" if not layout.storage.is_file(layout.storage.join(path, MANIFEST)) else "corrupt"
        return StepRow(step, name, status, detail=str(exc))
    return StepRow(step, name, "valid", m.total_bytes, m.wall.get("total_s"), m.wall.get("stall_s"),
                   now - m.created_unix if m.created_unix else None, eval_loss=m.eval_loss)


def job_roots_hint(root: Location, limit: int = 100) -> str | None:
    """When ``root`` holds no steps but its subdirectories do (``checkpoint.dir`` given instead of
    ``checkpoint.dir/<job name>``), a line naming them; a step's own directory given instead of
    its job's root (it read as 'no checkpoints, a fresh start'), a line saying so; else None."""
    layout = CheckpointLayout(root)
    if layout.storage.is_file(layout.storage.join(root, MANIFEST)):
        return (f"{root} is one step's directory, not a job's checkpoint root; check it with: raytrain-ckpt verify "
                f"{root}, or list its job with: raytrain-ckpt ls {parent_of(root)}")
    names = []
    for name in layout.storage.listdir(root)[:limit]:
        child = layout.storage.join(root, name)
        if parse_entry(name) is None and layout.storage.is_dir(child) and CheckpointLayout(child).entries():
            names.append(name)
    if not names:
        return None
    return (f"{root} holds no steps itself, but job checkpoint roots: {', '.join(names)}; pass one, e.g. "
            f"{layout.storage.join(root, names[0])}")


def resume_point(rows: list[StepRow]) -> StepRow | None:
    """The step ``checkpoint.resume: latest`` loads: the newest valid one."""
    valid = [r for r in rows if r.status == "valid"]
    return max(valid, key=lambda r: r.step) if valid else None


def _location(text: str) -> Location:
    """A path or URI from the command line."""
    if is_uri(text):
        return text.rstrip("/")
    problem = home_problem(text)
    if problem:
        raise UsageError(f"{text}: {problem}")
    return Path(text).expanduser()


def verify_step(path: Location, progress: Callable[[int], None] = lambda n: None) -> list[str]:
    """Every problem of a step directory against its manifest (sizes and checksums); [] means valid."""
    layout = CheckpointLayout(parent_of(path))
    try:
        manifest = layout.read_manifest(path)
    except InvalidCheckpoint as exc:
        return [str(exc)]
    return list(layout.problems(path, manifest, "checksum", progress))


# --- live: a running job's CheckpointActor -------------------------------------------------

def live_status(job: str, address: str | None) -> ActorStatus:
    """The CheckpointActor's status of a running job; raises UsageError when there is none."""
    import ray

    from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, actor_name

    if not ray.is_initialized():
        target = address or os.environ.get("RAY_ADDRESS") or "auto"
        problem = unreachable_address(target)
        if problem:
            raise UsageError(f"--job {job}: cannot reach a Ray cluster at {target} ({problem}); start one, "
                             "or pass --address / RAY_ADDRESS")
        try:
            ray.init(address=target, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
        except ConnectionError as exc:
            raise UsageError(f"--job {job}: cannot reach a Ray cluster at {target} ({_one_line(exc)}); start one, "
                             "or pass --address / RAY_ADDRESS") from None
    try:
        actor = ray.get_actor(actor_name(job), namespace=NAMESPACE)
    except ValueError:
        raise UsageError(f"--job {job}: no running job of that name on this cluster (no actor "
                         f"{actor_name(job)} in namespace {NAMESPACE}); check the name and --address") from None
    return ray.get(actor.status.remote(), timeout=30)


CONNECT_TIMEOUT_S = 5.0
"""How long ``status --job`` and ``run`` wait for a TCP connection to an explicit Ray address:
Ray's own client retries an address where nothing answers for minutes."""


def unreachable_address(target: str) -> str | None:
    """Why nothing accepts connections at a ``host:port`` (or ``ray://host:port``) address, or None.
    ``auto`` and other forms are left to Ray, which finds a local cluster itself."""
    import socket

    host, sep, port = target.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return f"nothing answers at {host}:{port} within {CONNECT_TIMEOUT_S:.0f} s: {exc.strerror or exc}"
    return None


def _positive_seconds(text: str) -> float:
    """argparse type of ``--watch``: a refresh period > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds > 0, e.g. 2")
    return value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def live_rows(status: ActorStatus, now: float | None = None) -> list[StepRow]:
    now = now or time.time()
    rows = [StepRow(s, step_name(s), "valid", info.bytes, info.wall.get("total_s"), info.wall.get("stall_s"),
                    now - info.created_unix if info.created_unix else None)
            for s, info in status.steps.items()]
    rows += [StepRow(s, step_name(s), "aborted", detail=reason) for s, reason in status.failed.items()
             if s not in status.steps]
    inflight = status.inflight
    if inflight.step is not None:
        rows.append(StepRow(inflight.step, step_name(inflight.step), "in-flight",
                            detail=phase_text(inflight.phase_name, inflight.ranks, status.world_size)))
    return sorted(rows, key=lambda r: r.step)


# --- output ---------------------------------------------------------------------------------

def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return f"{value / 1e6:.1f} MB"
    if kind == "age":
        s = int(value)
        return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
    return f"{value:.3f}s"


def table(rows: list[StepRow]) -> str:
    lines = [f"{'STEP':>9}  {'STATUS':<11} {'SIZE':>10} {'SAVE':>8} {'STALL':>8} {'AGE':>7}  DETAIL"]
    for r in rows:
        lines.append(f"{r.step:>9}  {r.status:<11} {_fmt(r.bytes, 'bytes'):>10} {_fmt(r.save_s, 's'):>8} "
                     f"{_fmt(r.stall_s, 's'):>8} {_fmt(r.age_s, 'age'):>7}  {r.detail}")
    return "\n".join(lines)


def status_report(target: str | None, job: str | None, address: str | None,
                  level: Verify = "size") -> tuple[str, dict[str, Any]]:
    """The text and the JSON form of ``status``, for a directory or a live job."""
    if job is not None:
        live = live_status(job, address)
        st = live.to_dict()  # the JSON view: what --json prints and the summary lines read
        rows, root = live_rows(live), live.root
        point = f"step {live.latest}" if live.latest is not None else "none (a fresh start)"
        info, risk = st["job_info"], st["at_risk"]
        head = (f"job {live.job}: {info.get('state', '?')}, attempt {info.get('attempt', 0)}, training step "
                f"{info.get('train_step', '?')}; {summary_line(st)}; work at risk {risk['steps']} steps, "
                f"{risk['seconds']:.0f}s")
        failing = failed_saves_text(st)
        if failing is not None:
            head += f"\nsaves failing: {failing}"
        interval = st["interval"]
        if interval is not None:
            head += f"\n{interval_text(interval)}"
        data = {"root": root, "job": info, "summary": summary_line(st), "at_risk": risk,
                "failed_saves": st["failed_saves"], "interval": interval}
    else:
        root = _root(target)
        rows = scan(root, level)
        best = resume_point(rows)
        point = f"step {best.step} ({root}/{best.name})" if best else "none (a fresh start)"
        head = f"checkpoints in {root}: {sum(r.status == 'valid' for r in rows)} valid of {len(rows)}"
        hint = None if rows else job_roots_hint(root)
        if hint:
            head += f"\nnote: {hint}"
        data = {"root": str(root)}
    resume = next((r.step for r in reversed(rows) if r.status == "valid"), None)
    data |= {"resume_step": resume, "steps": [asdict(r) for r in rows]}
    return f"{head}\n{table(rows)}\nresume point: {point}", data


def interval_text(interval: dict[str, Any]) -> str:
    """``checkpoint interval (auto): 12 steps, chosen at step 30 (cost 0.080 s, ...)``."""
    why = IntervalDecision(**{k: v for k, v in interval.items() if k != "step"}).describe()
    return f"checkpoint interval (auto): {interval['steps']} steps, chosen at step {interval['step']} ({why})"


def _root(target: str | None) -> Location:
    if target is None:
        raise UsageError("status: give a checkpoint directory (checkpoint.dir/<job name>) or --job NAME")
    root = _location(target)
    if not CheckpointLayout(root).storage.is_dir(root):
        raise UsageError(f"{target}: not a directory; pass a job's checkpoint root, e.g. checkpoints/llama-debug-fsdp")
    return root


# --- command line -----------------------------------------------------------------------------

def add_parsers(sub: Any) -> None:
    """Add ``status``, ``ls`` and ``verify`` to the CLI's subparsers."""
    st = sub.add_parser("status", help="checkpoint progress of a running job (--job) or a checkpoint directory")
    st.add_argument("dir", nargs="?", help="a job's checkpoint root (checkpoint.dir/<job name>)")
    st.add_argument("--job", help="name of a running job: ask its CheckpointActor")
    st.add_argument("--address", help="Ray address for --job; default: RAY_ADDRESS, else the local cluster")
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
            return _verify(_location(args.step_dir), args.json)
        if args.command == "ls":
            rows = scan(_root(args.dir), "checksum" if args.checksum else "size")
            hint = None if rows else job_roots_hint(_root(args.dir))
            if hint:
                print(f"note: {hint}", file=sys.stderr)
            print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else
                  "\n".join(f"{r.name:<34} {r.status:<11} {_fmt(r.bytes, 'bytes'):>10} {_eval_text(r):>12}  {r.detail}"
                            for r in rows))
            return EXIT_OK
        if args.job is not None and args.dir is not None:
            raise UsageError("status: give either a checkpoint directory or --job, not both")
        return _status(args, refreshes)
    except (UsageError, StorageUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a path that cannot be read (permissions, a vanished mount): one line, not a traceback
        print(f"error: {args.command}: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE if exc.errno == errno.ENAMETOOLONG else EXIT_BAD  # (a name no file system takes: a typo)


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
    n = 0
    while True:
        text, data = status_report(args.dir, args.job, args.address, "checksum" if args.checksum else "size")
        if args.watch is not None and sys.stdout.isatty():
            print("\x1b[2J\x1b[H", end="")  # clear the terminal: a refreshing view, not a scrolling log
        print(json.dumps(data, indent=1, default=str) if args.json else text, flush=True)
        n += 1
        if args.watch is None or (refreshes is not None and n >= refreshes):
            return EXIT_OK
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return EXIT_OK


def _verify(path: Location, as_json: bool) -> int:
    storage = CheckpointLayout(parent_of(path)).storage
    if not storage.is_dir(path):
        raise UsageError(f"{path}: no such step directory; pass one like checkpoints/<job>/step-00000040")
    name = storage.name(path)
    if parse_entry(name) is None:
        raise UsageError(f"{path}: not a step directory (expected a name like step-00000040)")
    total = _manifest_bytes(path)
    bar = _progress_bar(total, f"verify {name}")
    try:
        problems = verify_step(path, bar.update if bar else lambda n: None)
    finally:
        if bar:
            bar.close()
    status = "valid" if not problems else ("torn" if not storage.is_file(storage.join(path, MANIFEST)) else "corrupt")
    if as_json:
        print(json.dumps({"path": str(path), "status": status, "problems": problems}, indent=1))
    else:
        print(f"{path}: {status.upper()}" + ("" if problems else f" (every file's size and checksum match, "
                                                                  f"{total / 1e6:.1f} MB)"))
        for p in problems:
            print(f"  {p}")
    return EXIT_OK if not problems else EXIT_BAD


def _manifest_bytes(path: Location) -> int:
    try:
        return CheckpointLayout(parent_of(path)).read_manifest(path).total_bytes
    except InvalidCheckpoint:
        return 0


def _progress_bar(total: int, desc: str, unit: str = "B") -> Any:
    """A progress bar on stderr, only for an interactive terminal (logs and pipes stay clean)."""
    if total <= 0 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr)
