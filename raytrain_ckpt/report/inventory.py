"""The inventory of a job's checkpoints: every step entry with its status, from the manifests on
disk (``scan``) or from a running job's CheckpointActor (``live_status``), and the report
``status`` prints (``status_report``). The API half: ``api.py`` and the driver use it;
``cli/status.py`` puts ``raytrain-ckpt status | ls | verify`` on top.

A directory may be an object-store URI (``s3://bucket/prefix/<job>``; credentials and endpoint
from the environment, as boto reads them, e.g. ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytrain_ckpt.report import jobrecord
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, StepUnreadable

from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.checkpoint.format.sandbox import start_reader
from raytrain_ckpt.checkpoint.format.names import EntryKind, Location, parent_of, parse_entry, step_name
from raytrain_ckpt.common.events import printable
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.format.verify import Verify, step_problems
from raytrain_ckpt.checkpoint.policy.interval import IntervalDecision
from raytrain_ckpt.checkpoint.records import ActorStatus
from raytrain_ckpt.checkpoint.roles.summary import phase_text
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from raytrain_ckpt.common.locations import home_problem
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

logger = logging.getLogger(__name__)

__all__ = ["StepRow", "UsageError", "format_cell", "interval_text", "job_roots_hint", "live_rows", "live_status",
           "ending_line", "location", "progress_bar", "resume_point", "root_dir", "scan", "status_report", "table",
           "unreachable_address", "verify_step"]

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
    entries = layout.entries()
    loadable = [path for entry, path in entries if entry.kind.is_loadable]
    bar = progress_bar(len(entries), "checksum", unit="dir") if level == "checksum" else None
    verdicts = iter(layout.verify_many(loadable, level, bar.update if bar is not None else None))
    rows = []
    for entry, path in entries:
        if entry.kind.is_loadable:
            rows.append(_row(layout, path, entry.step, next(verdicts), now))
        else:
            if bar is not None:
                bar.update(1)
            status, detail = _ASIDE[entry.kind]
            rows.append(StepRow(entry.step, entry.name, status, detail=detail))
    if bar is not None:
        bar.close()
    return rows


def _row(layout: CheckpointLayout, path: Location, step: int, m: Manifest | InvalidCheckpoint, now: float) -> StepRow:
    name = layout.storage.name(path)
    if isinstance(m, InvalidCheckpoint):
        status = "unreadable" if isinstance(m, StepUnreadable) else \
            "torn" if not layout.storage.is_file(layout.storage.join(path, MANIFEST)) else "corrupt"
        return StepRow(step, name, status, detail=str(m))
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


def location(text: str) -> Location:
    """A path or URI from the command line."""
    if is_uri(text):
        return text.rstrip("/")
    problem = home_problem(text)
    if problem:
        raise UsageError(f"{text}: {problem}")
    return Path(text).expanduser()


def verify_step(path: Location, progress: Callable[[int], None] = lambda n: None) -> list[str]:
    """Every problem of a step directory against its manifest (sizes and checksums); [] means valid."""
    start_reader()  # (its start overlaps the checksums read before the .metadata check)
    return step_problems(path, open_storage(path), progress)


# --- live: a running job's CheckpointActor -------------------------------------------------

def live_status(job: str, address: str | None) -> ActorStatus:
    """The CheckpointActor's status of a running job; raises UsageError when there is none."""
    import ray

    from raytrain_ckpt.checkpoint.roles.client_asks import actor_status
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
    return actor_status(actor, timeout_s=30)


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


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def live_rows(status: dict[str, Any], now: float | None = None) -> list[StepRow]:
    """The status table's rows of a job's status (``ActorStatus.to_dict``, also read back from
    JSON, where step numbers are strings)."""
    now = now or time.time()
    steps = {int(s): info for s, info in (status.get("steps") or {}).items()}
    rows = [StepRow(s, step_name(s), "valid", info["bytes"], info["wall"].get("total_s"), info["wall"].get("stall_s"),
                    now - info["created_unix"] if info.get("created_unix") else None)
            for s, info in steps.items()]
    rows += [StepRow(int(s), step_name(int(s)), "aborted", detail=reason)
             for s, reason in (status.get("failed") or {}).items() if int(s) not in steps]
    inflight = status.get("inflight") or {}
    if inflight.get("step") is not None:
        ranks = {int(r): v for r, v in inflight["ranks"].items()}
        rows.append(StepRow(inflight["step"], step_name(inflight["step"]), "in-flight",
                            detail=phase_text(inflight["phase"], ranks, status["world_size"])))
    return sorted(rows, key=lambda r: r.step)


# --- output ---------------------------------------------------------------------------------

def format_cell(value: float | None, kind: str) -> str:
    """One cell of the status table: bytes as MB, an age as minutes or hours, else seconds; ``-`` for None."""
    if value is None:
        return "-"
    if kind == "bytes":
        return f"{value / 1e6:.1f} MB"
    if kind == "age":
        s = int(value)
        return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
    return f"{value:.3f}s"


def table(rows: list[StepRow]) -> str:
    """The status table (the text form of ``status``'s rows)."""
    lines = [f"{'STEP':>9}  {'STATUS':<11} {'SIZE':>10} {'SAVE':>8} {'STALL':>8} {'AGE':>7}  DETAIL"]
    for r in rows:
        lines.append(f"{r.step:>9}  {r.status:<11} {format_cell(r.bytes, 'bytes'):>10} "
                     f"{format_cell(r.save_s, 's'):>8} {format_cell(r.stall_s, 's'):>8} "
                     f"{format_cell(r.age_s, 'age'):>7}  {r.detail}")
    return "\n".join(lines)


def status_report(target: str | None, level: Verify = "size") -> tuple[str, dict[str, Any]]:
    """The text and the JSON form of ``status DIR`` (a job's: ``jobstatus.job_report``)."""
    root = root_dir(target)
    rows = scan(root, level)
    best = resume_point(rows)
    point = f"step {best.step} ({root}/{best.name})" if best else "none (a fresh start)"
    head = f"checkpoints in {root}: {sum(r.status == 'valid' for r in rows)} valid of {len(rows)}"
    hint = None if rows else job_roots_hint(root)
    if hint:
        head += f"\nnote: {hint}"
    data: dict[str, Any] = {"root": str(root)}
    record = jobrecord.read_root(root)
    if record is not None:  # the run that wrote these steps: how it ended, or that it runs
        head += f"\n{ending_line(record)}"
        data["job"] = record.get("job_info")
    resume = next((r.step for r in reversed(rows) if r.status == "valid"), None)
    data |= {"resume_step": resume, "steps": [asdict(r) for r in rows]}
    return f"{head}\n{table(rows)}\nresume point: {point}", data


def ending_line(record: dict[str, Any], now: float | None = None) -> str:
    """``job x: SUCCEEDED 2m05s ago, attempt 1, training step 40, last committed step 40``, from a job's record."""
    info = record.get("job_info") or {}
    state, ended = info.get("state", "?"), record.get("ended_unix")
    when = f" {format_cell((now or time.time()) - ended, 'age')} ago" if ended else " (no end recorded)"
    latest = record.get("latest")
    line = (f"job {record.get('job', '?')}: {state}{when}, attempt {info.get('attempt', 0)}, training step "
            f"{info.get('train_step') if info.get('train_step') is not None else '-'}, last committed step "
            f"{latest if latest is not None else '-'}")
    if record.get("stopped"):
        line += f"; stopped by {record['stopped']}"
    # the record is a file in the root: what anyone who can write there put in it stays one visible line
    return printable(line + (f"; error: {record['error']}" if record.get("error") else ""))


def interval_text(interval: dict[str, Any]) -> str:
    """``checkpoint interval (auto): 12 steps, chosen at step 30 (cost 0.080 s, ...)``."""
    why = IntervalDecision(**{k: v for k, v in interval.items() if k != "step"}).describe()
    return f"checkpoint interval (auto): {interval['steps']} steps, chosen at step {interval['step']} ({why})"


def root_dir(target: str | None) -> Location:
    """A job's checkpoint root named on the command line, checked to be a directory; raises UsageError."""
    if target is None:
        raise UsageError("status: give a checkpoint directory (checkpoint.dir/<job name>) or --job NAME")
    root = location(target)
    if not open_storage(root).is_dir(root):
        raise UsageError(f"{target}: not a directory; pass a job's checkpoint root, e.g. checkpoints/llama-debug-fsdp")
    return root


def progress_bar(total: int, desc: str, unit: str = "B") -> Any:
    """A progress bar on stderr, only for an interactive terminal (logs and pipes stay clean)."""
    if total <= 0 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr)
