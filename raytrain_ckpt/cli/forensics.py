"""``raytrain-ckpt diff | stats | bisect``: what a committed step holds, tensor by tensor.

``stats STEP [--tensor NAME]`` prints each tensor's fingerprint (element count, sum, L2 norm,
NaN and Inf counts, CRC-32C of its bytes); ``diff STEP_A STEP_B`` lists the tensors whose bytes
differ and by how much their norms moved (identical steps say so); ``bisect ROOT --check finite``
finds the first committed step that holds a non-finite value, looking at O(log n) steps: a model
that went non-finite stays so (every later step is computed from it); a step whose manifest
records per-tensor fingerprints (its writers summed them) is judged from them without reading
a tensor. Tensors are read one at a
time from the DCP files (``checkpoint/format/fingerprints.py``). Exit codes: 0 fine (``bisect``:
every step finite), 1 ``bisect`` found a non-finite step, 2 a user mistake (also a path that
cannot be read for want of permission).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_ckpt.checkpoint.errors import ExitCode, InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.checkpoint.format.names import EntryKind, parse_entry

if TYPE_CHECKING:
    from raytrain_ckpt.checkpoint.format.fingerprints import TensorStats

__all__ = ["add_parsers", "run"]


class _Usage(ValueError):
    """A user mistake: one line, exit 2."""


def add_parsers(sub: Any) -> None:
    """Add ``diff``, ``stats`` and ``bisect`` to the CLI's subparsers."""
    d = sub.add_parser("diff", help="which tensors differ between two committed steps, and by how much")
    d.add_argument("step_a", help="a step directory, e.g. checkpoints/llama-debug-fsdp/step-00000040")
    d.add_argument("step_b", help="another step directory")
    d.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    s = sub.add_parser("stats", help="per-tensor fingerprints of a committed step (count, sum, norm, NaN/Inf)")
    s.add_argument("step_dir", help="a step directory")
    s.add_argument("--tensor", help="only this tensor (a name as stats lists it, e.g. model.tok_emb.weight)")
    s.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    b = sub.add_parser("bisect", help="the first committed step of a checkpoint root that fails a check")
    b.add_argument("dir", help="a job's checkpoint root (checkpoint.dir/<job name>)")
    b.add_argument("--check", choices=("finite",), required=True, help="finite: no NaN or Inf in any tensor")


def run(args: argparse.Namespace) -> int:
    """Run ``diff``, ``stats`` or ``bisect``; user mistakes print one line and return 2."""
    try:
        if args.command == "stats":
            return _stats(_step_dir(args.step_dir), args.tensor, args.json)
        if args.command == "diff":
            return _diff(_step_dir(args.step_a), _step_dir(args.step_b), args.json)
        return _bisect(Path(args.dir))
    except _Usage as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except OSError as exc:  # a step or root that cannot be read (no permission): one line, not a traceback
        from raytrain_ckpt.cli import os_error_exit

        given = [getattr(args, name, None) for name in ("step_dir", "step_a", "step_b", "dir")]
        code, line = os_error_exit(exc, *given)
        print(f"error: {args.command}: {line}", file=sys.stderr)
        return code


def _step_dir(text: str) -> Path:
    path = Path(text)
    if not (path / MANIFEST).is_file():
        raise _Usage(f"{text}: not a committed step directory (no {MANIFEST}); list the steps with raytrain-ckpt ls ROOT")
    return path


def _read(path: Path, only: str | None = None) -> dict[str, TensorStats]:
    from raytrain_ckpt.checkpoint.format.fingerprints import step_stats  # torch: only for these commands

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return step_stats(path, only)
    except KeyError:
        raise _Usage(f"--tensor {only}: no such tensor in {path}; raytrain-ckpt stats {path} lists them") from None
    except (InvalidCheckpoint, OSError, CheckpointException) as exc:  # (DCP wraps a refused chunk in the last)
        raise _Usage(f"{path}: unreadable ({_cause(exc)}); check it with raytrain-ckpt verify {path}") from None


def _cause(exc: BaseException) -> BaseException:
    """The first rank's error inside DCP's ``CheckpointException`` (it only names the ranks), else ``exc``."""
    failures = getattr(exc, "failures", None)
    first = next(iter(failures.values()), None) if isinstance(failures, dict) else None
    return first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else exc


def _stats(path: Path, only: str | None, as_json: bool) -> int:
    stats = _read(path, only)
    if as_json:
        print(json.dumps({name: s.as_dict() for name, s in stats.items()}, indent=1))
        return ExitCode.OK
    print(f"{'tensor':48} {'numel':>10} {'sum':>14} {'norm':>12} {'nan':>6} {'inf':>6}")
    for name, s in stats.items():
        print(f"{name:48} {s.numel:>10} {s.sum:>14.6g} {s.norm:>12.6g} {s.nan:>6} {s.inf:>6}")
    return ExitCode.OK


def _diff(a: Path, b: Path, as_json: bool) -> int:
    from torch.distributed.checkpoint.api import CheckpointException

    from raytrain_ckpt.checkpoint.format.fingerprints import diff_step_dirs

    try:
        diffs = diff_step_dirs(a, b)
    except (InvalidCheckpoint, OSError, CheckpointException) as exc:
        raise _Usage(f"{a} or {b}: unreadable ({_cause(exc)}); check them with raytrain-ckpt verify") from None
    if as_json:
        print(json.dumps([{"tensor": d.name, "a": d.a.as_dict() if d.a else None, "b": d.b.as_dict() if d.b else None,
                           "delta_norm": d.delta_norm} for d in diffs], indent=1))
        return ExitCode.OK
    if not diffs:
        print(f"identical: every tensor of {a.name} and {b.name} has the same bytes")
        return ExitCode.OK
    print(f"{len(diffs)} tensor(s) differ between {a.name} and {b.name}:")
    for d in diffs:
        if d.a is None or d.b is None:
            print(f"  {d.name}: only in {b.name if d.a is None else a.name}")
        else:
            print(f"  {d.name}: norm {d.a.norm:.6g} -> {d.b.norm:.6g} (|delta| {_norm(d.delta_norm)}), "
                  f"sum {d.a.sum:.6g} -> {d.b.sum:.6g}, nan {d.a.nan} -> {d.b.nan}, inf {d.a.inf} -> {d.b.inf}")
    return ExitCode.OK


def _norm(value: float | None) -> str:
    return "n/a (shapes differ)" if value is None else f"{value:.3g}"


def _committed_steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        raise _Usage(f"{root}: no such checkpoint root; give checkpoint.dir/<job name>")
    out = []
    for child in root.iterdir():
        entry = parse_entry(child.name)
        if entry is not None and entry.kind is EntryKind.COMMITTED and (child / MANIFEST).is_file():
            out.append((entry.step, child))
    if not out:
        raise _Usage(f"{root}: no committed step to check")
    return sorted(out)


def _bad(path: Path) -> str | None:
    """The first non-finite tensor of the step at ``path`` and its counts, or None: from the
    fingerprints its manifest records when it has them (no tensor is read), else from its files."""
    try:
        recorded = Manifest.from_json((path / MANIFEST).read_text()).tensors
    except (InvalidCheckpoint, OSError) as exc:
        raise _Usage(f"{path}/{MANIFEST}: unreadable ({exc}); check it with raytrain-ckpt verify {path}") from None
    if recorded:
        for name, row in recorded.items():
            if row.get("nan") or row.get("inf"):
                return f"{name} (nan {int(row.get('nan', 0))}, inf {int(row.get('inf', 0))})"
        return None
    for name, s in _read(path).items():
        if not s.finite:
            return f"{name} (nan {s.nan}, inf {s.inf})"
    return None


def _bisect(root: Path) -> int:
    steps = _committed_steps(root)
    lo, hi, found = 0, len(steps) - 1, None
    checked = 0
    while lo <= hi:
        mid = (lo + hi) // 2
        checked += 1
        why = _bad(steps[mid][1])
        if why is None:
            lo = mid + 1
        else:
            found, hi = (steps[mid][0], why), mid - 1
    if found is None:
        print(f"every committed step is finite ({len(steps)} step(s), {checked} read)")
        return ExitCode.OK
    print(f"first non-finite step: {found[0]} ({found[1]}); {checked} of {len(steps)} step(s) read")
    return ExitCode.FAILED
