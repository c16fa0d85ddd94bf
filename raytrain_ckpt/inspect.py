"""``raytrain-ckpt status | ls | verify``: checkpoint progress of a running job or of a directory.

``status --job NAME`` asks the job's live CheckpointActor (named ``rtc-ckpt-<job>`` in the
``raytrain_ckpt`` Ray namespace); ``status DIR`` and ``ls DIR`` read the manifests on disk;
``verify DIR/step-N`` checks every file's size and CRC-32. Exit codes: 0 fine, 1 ``verify``
found the step torn or corrupt, 2 a user mistake (a missing path, no such job, a bad flag).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytrain_ckpt.checkpoint.layout import MANIFEST, CheckpointLayout, InvalidCheckpoint, Verify

logger = logging.getLogger(__name__)

__all__ = ["StepRow", "add_parsers", "run", "scan", "summary_line", "verify_step"]

EXIT_OK, EXIT_BAD, EXIT_USAGE = 0, 1, 2
_ENTRY_RE = re.compile(r"^step-(\d+)(?:\.(tmp|invalid)-[0-9a-f]+)?$")
_CHUNK = 8 << 20


class UsageError(ValueError):
    """A user mistake: printed as one line, exit code 2."""


@dataclass
class StepRow:
    """One line of the status table."""

    step: int
    name: str
    status: str
    """valid, in-flight, torn (never committed), corrupt (fails its manifest), moved-aside, aborted."""
    bytes: int | None = None
    save_s: float | None = None
    stall_s: float | None = None
    age_s: float | None = None
    detail: str = ""


# --- offline: a checkpoint directory -------------------------------------------------------

def scan(root: Path, level: Verify = "size", now: float | None = None) -> list[StepRow]:
    """Every step entry under a job's checkpoint root, with its status (file sizes, or also CRC-32, checked)."""
    layout, now = CheckpointLayout(root), now or time.time()
    rows = []
    entries = sorted(root.iterdir(), key=lambda p: p.name)
    bar = _progress_bar(len(entries), "checksum", unit="dir") if level == "checksum" else None
    for entry in entries:
        if bar is not None:
            bar.update(1)
        m = _ENTRY_RE.match(entry.name)
        if m is None:
            continue
        step, kind = int(m.group(1)), m.group(2)
        if kind == "tmp":
            rows.append(StepRow(step, entry.name, "torn", detail="no manifest: being written, or left by a crash"))
        elif kind == "invalid":
            rows.append(StepRow(step, entry.name, "moved-aside", detail="an invalid step-N moved aside by a re-save"))
        else:
            rows.append(_row(layout, entry, step, level, now))
    if bar is not None:
        bar.close()
    return rows


def _row(layout: CheckpointLayout, path: Path, step: int, level: Verify, now: float) -> StepRow:
    try:
        m = layout.verify(path, level)
    except InvalidCheckpoint as exc:
        status = "torn" if not (path / MANIFEST).is_file() else "corrupt"
        return StepRow(step, path.name, status, detail=str(exc))
    return StepRow(step, path.name, "valid", m.total_bytes, m.wall.get("total_s"), m.wall.get("stall_s"),
                   now - m.created_unix if m.created_unix else None)


def resume_point(rows: list[StepRow]) -> StepRow | None:
    """The step ``checkpoint.resume: latest`` loads: the newest valid one."""
    valid = [r for r in rows if r.status == "valid"]
    return max(valid, key=lambda r: r.step) if valid else None


def verify_step(path: Path, progress: Callable[[int], None] = lambda n: None) -> list[str]:
    """Every problem of a step directory against its manifest (sizes and CRC-32); [] means valid."""
    layout = CheckpointLayout(path.parent)
    try:
        manifest = layout.read_manifest(path)
    except InvalidCheckpoint as exc:
        return [str(exc)]
    problems = []
    m = _ENTRY_RE.match(path.name)
    if m is None or int(m.group(1)) != manifest.step or m.group(2):
        problems.append(f"{path.name} holds the manifest of step {manifest.step} (not a committed step-N name)")
    if ".metadata" not in manifest.files:
        problems.append("the manifest lists no .metadata")
    for name, want in sorted(manifest.files.items()):
        problems += _check_file(path / name, want, progress)
    return problems


def _check_file(path: Path, want: dict[str, int], progress: Callable[[int], None]) -> list[str]:
    if not path.is_file():
        progress(want["size"])
        return [f"{path.name} is missing"]
    size = path.stat().st_size
    if size != want["size"]:
        progress(want["size"])
        return [f"{path.name} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)"]
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            progress(len(chunk))
    return [] if crc == want["crc32"] else [f"{path.name} fails its CRC-32 check (corrupt)"]


# --- live: a running job's CheckpointActor -------------------------------------------------

def live_status(job: str, address: str | None) -> dict[str, Any]:
    """The CheckpointActor's status of a running job; raises UsageError when there is none."""
    import ray

    from raytrain_ckpt.checkpoint.service import NAMESPACE, actor_name

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace=NAMESPACE,
                 logging_level=logging.WARNING, log_to_driver=False)
    try:
        actor = ray.get_actor(actor_name(job), namespace=NAMESPACE)
    except ValueError:
        raise UsageError(f"--job {job}: no running job of that name on this cluster (no actor "
                         f"{actor_name(job)} in namespace {NAMESPACE}); check the name and --address") from None
    return ray.get(actor.status.remote(), timeout=30)


def live_rows(status: dict[str, Any], now: float | None = None) -> list[StepRow]:
    now = now or time.time()
    rows = [StepRow(int(s), f"step-{int(s):08d}", "valid", info["bytes"], info["wall"].get("total_s"),
                    info["wall"].get("stall_s"), now - info["created_unix"] if info["created_unix"] else None)
            for s, info in status["steps"].items()]
    rows += [StepRow(int(s), f"step-{int(s):08d}", "aborted", detail=reason) for s, reason in status["failed"].items()
             if int(s) not in status["steps"]]
    inflight = status["inflight"]
    if inflight["step"] is not None:
        rows.append(StepRow(inflight["step"], f"step-{inflight['step']:08d}", "in-flight",
                            detail=_phase_text(inflight, status["world_size"])))
    return sorted(rows, key=lambda r: r.step)


def _phase_text(inflight: dict[str, Any], world_size: int) -> str:
    values = list(inflight["ranks"].values())
    done = {"staging": sum(v >= 1 for v in values), "writing": sum(v >= 2 for v in values)}
    n = done.get(inflight["phase"], world_size if inflight["phase"] == "committing" else 0)
    return f"{inflight['phase']} {n}/{world_size} ranks"


def summary_line(status: dict[str, Any]) -> str:
    """``committed=120 inflight=130 writing 3/4 ranks``: the one-line view of a CheckpointActor."""
    text = f"committed={status['latest'] if status['latest'] is not None else '-'}"
    inflight = status["inflight"]
    if inflight["step"] is None:
        return text + " inflight=-"
    return text + f" inflight={inflight['step']} {_phase_text(inflight, status['world_size'])}"


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
        st = live_status(job, address)
        rows, root = live_rows(st), st["root"]
        point = f"step {st['latest']}" if st["latest"] is not None else "none (a fresh start)"
        info, risk = st.get("job_info") or {}, st["at_risk"]
        head = (f"job {st['job']}: {info.get('state', '?')}, attempt {info.get('attempt', 0)}, training step "
                f"{info.get('train_step', '?')}; {summary_line(st)}; work at risk {risk['steps']} steps, "
                f"{risk['seconds']:.0f}s")
        data = {"root": root, "job": info, "summary": summary_line(st), "at_risk": risk}
    else:
        root = _root(target)
        rows = scan(root, level)
        best = resume_point(rows)
        point = f"step {best.step} ({root / best.name})" if best else "none (a fresh start)"
        head = f"checkpoints in {root}: {sum(r.status == 'valid' for r in rows)} valid of {len(rows)}"
        data = {"root": str(root)}
    resume = next((r.step for r in reversed(rows) if r.status == "valid"), None)
    data |= {"resume_step": resume, "steps": [asdict(r) for r in rows]}
    return f"{head}\n{table(rows)}\nresume point: {point}", data


def _root(target: str | None) -> Path:
    if target is None:
        raise UsageError("status: give a checkpoint directory (checkpoint.dir/<job name>) or --job NAME")
    root = Path(target).expanduser()
    if not root.is_dir():
        raise UsageError(f"{target}: not a directory; pass a job's checkpoint root, e.g. checkpoints/llama-debug-fsdp")
    return root


# --- command line -----------------------------------------------------------------------------

def add_parsers(sub: Any) -> None:
    """Add ``status``, ``ls`` and ``verify`` to the CLI's subparsers."""
    st = sub.add_parser("status", help="checkpoint progress of a running job (--job) or a checkpoint directory")
    st.add_argument("dir", nargs="?", help="a job's checkpoint root (checkpoint.dir/<job name>)")
    st.add_argument("--job", help="name of a running job: ask its CheckpointActor")
    st.add_argument("--address", help="Ray address for --job; default: RAY_ADDRESS, else the local cluster")
    st.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                    help="refresh every SECONDS (default 2) until Ctrl-C")
    st.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    st.add_argument("--checksum", action="store_true", help="with a directory: also check every file's CRC-32")
    ls = sub.add_parser("ls", help="list the steps of a checkpoint directory with their status")
    ls.add_argument("dir", help="a job's checkpoint root (checkpoint.dir/<job name>)")
    ls.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    ls.add_argument("--checksum", action="store_true", help="also check every file's CRC-32 (reads every file)")
    v = sub.add_parser("verify", help="check every file of a step against its manifest (size and CRC-32)")
    v.add_argument("step_dir", help="a step directory, e.g. checkpoints/llama-debug-fsdp/step-00000040")
    v.add_argument("--json", action="store_true", help="print JSON (for scripts)")


COMMANDS = ("status", "ls", "verify")


def run(args: argparse.Namespace, refreshes: int | None = None) -> int:
    """Run one of COMMANDS; user mistakes print one line and return 2."""
    try:
        if args.command == "verify":
            return _verify(Path(args.step_dir), args.json)
        if args.command == "ls":
            rows = scan(_root(args.dir), "checksum" if args.checksum else "size")
            print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else
                  "\n".join(f"{r.name:<34} {r.status:<11} {_fmt(r.bytes, 'bytes'):>10}  {r.detail}" for r in rows))
            return EXIT_OK
        if args.job is not None and args.dir is not None:
            raise UsageError("status: give either a checkpoint directory or --job, not both")
        return _status(args, refreshes)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


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


def _verify(path: Path, as_json: bool) -> int:
    if not path.is_dir():
        raise UsageError(f"{path}: no such step directory; pass one like checkpoints/<job>/step-00000040")
    if _ENTRY_RE.match(path.name) is None:
        raise UsageError(f"{path}: not a step directory (expected a name like step-00000040)")
    total = _manifest_bytes(path)
    bar = _progress_bar(total, f"verify {path.name}")
    try:
        problems = verify_step(path, bar.update if bar else lambda n: None)
    finally:
        if bar:
            bar.close()
    status = "valid" if not problems else ("torn" if not (path / MANIFEST).is_file() else "corrupt")
    if as_json:
        print(json.dumps({"path": str(path), "status": status, "problems": problems}, indent=1))
    else:
        print(f"{path}: {status.upper()}" + ("" if problems else f" (every file's size and CRC-32 match, "
                                                                  f"{total / 1e6:.1f} MB)"))
        for p in problems:
            print(f"  {p}")
    return EXIT_OK if not problems else EXIT_BAD


def _manifest_bytes(path: Path) -> int:
    try:
        return CheckpointLayout(path.parent).read_manifest(path).total_bytes
    except InvalidCheckpoint:
        return 0


def _progress_bar(total: int, desc: str, unit: str = "B") -> Any:
    """A progress bar on stderr, only for an interactive terminal (logs and pipes stay clean)."""
    if total <= 0 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr)
