"""The NCCL flight recorder of every rank, dumped when the group hangs.

NCCL's flight recorder (torch's ``ProcessGroupNCCL``) keeps the last collectives each rank
issued, with their sequence numbers, sizes, states and Python stacks: which rank never entered
the collective the others wait in, seen from inside NCCL. It is on only when
``TORCH_NCCL_TRACE_BUFFER_SIZE`` (or ``TORCH_FR_BUFFER_SIZE``) is set before the process group
is made, so a rank sets it to ``TRACE_ENTRIES`` just before it joins an NCCL group, unless the
process has either already (the user's setting, 0 included, is kept). On a hang each rank is
asked (from its second actor thread, while its training thread is stuck) for the dump: pickled
bytes, written as they are to ``<diagnostics>/attempt-<N>/rank-<R>.nccl_trace.pkl`` and never
unpickled here (torch's ``torch.distributed.flight_recorder.fr_trace`` reads copies named
``<prefix><rank>``, README "Hangs").
A gloo (CPU) rank answers ``no flight recorder: backend gloo`` and nothing is written.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["TRACE_ENTRIES", "TRACE_ENV", "dump_trace", "enable_recorder", "keep_traces", "rank_trace", "trace_file",
           "traces_in"]

TRACE_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
_FR_ENV = "TORCH_FR_BUFFER_SIZE"
"""Newer torch's name for the same setting (read first by torch when both are set)."""
_SUFFIX = ".nccl_trace.pkl"
TRACE_ENTRIES = 2000
"""How many of its latest collectives each NCCL rank keeps (torch's usual size; a few MiB)."""


def enable_recorder(env: MutableMapping[str, str] | None = None) -> str:
    """Turn the flight recorder on in ``env`` (this process's environment) unless it is set
    already; returns the size in force."""
    env = os.environ if env is None else env
    for key in (_FR_ENV, TRACE_ENV):
        if env.get(key):
            return env[key]
    env[TRACE_ENV] = str(TRACE_ENTRIES)
    return env[TRACE_ENV]


def dump_trace(backend: str | None) -> bytes | str:
    """This process's flight recorder as torch pickles it, or why there is none (a str)."""
    if backend != "nccl":
        return f"no flight recorder: backend {backend or 'none (no process group)'}"
    size = os.environ.get(_FR_ENV) or os.environ.get(TRACE_ENV) or "0"
    if size.strip() in ("", "0"):
        return f"no flight recorder: {TRACE_ENV}={size} (set it above 0 to keep one)"
    import torch

    c10d = torch._C._distributed_c10d
    # _dump_nccl_trace is NCCL's own recorder (the one its process groups write to); newer torch
    # also has _dump_fr_trace, the recorder of the other backends, which holds no NCCL entry
    # (seen on torch 2.11: an empty dump after an NCCL all_reduce). The same pickled dict.
    dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return f"no flight recorder: torch {torch.__version__} has no dump function"
    try:
        return bytes(dump())
    except Exception as exc:  # noqa: BLE001 - a rank whose dump fails says why; the others still write theirs
        return f"no flight recorder: the dump failed: {type(exc).__name__}: {exc}"


def rank_trace() -> bytes | str:
    """The dump of this process's default process group's flight recorder, or why there is none."""
    import torch.distributed as dist

    return dump_trace(dist.get_backend() if dist.is_initialized() else None)


def trace_file(folder: Path, rank: int) -> Path:
    """Where rank ``rank``'s dump goes in a hang's diagnostics folder."""
    return folder / f"rank-{rank}{_SUFFIX}"


def traces_in(folder: Path) -> list[int]:
    """The ranks whose dump a hang's diagnostics folder holds, in order."""
    ranks = (p.name[5:-len(_SUFFIX)] for p in folder.glob(f"rank-*{_SUFFIX}") if p.is_file())
    return sorted(int(r) for r in ranks if r.isdigit())


def keep_traces(folder: Path, answers: dict[int, bytes | str], world_size: int) -> list[str]:
    """Write every dump in ``answers`` (rank -> bytes, or why none) to ``folder``; one line per
    rank for the verdict: the file and its size, or why there is none."""
    lines = []
    for rank in range(world_size):
        answer = answers.get(rank, "did not answer")
        if isinstance(answer, bytes) and answer:
            path = trace_file(folder, rank)
            path.write_bytes(answer)
            lines.append(f"rank {rank} nccl trace: {path.name} ({len(answer)} bytes)")
        else:
            lines.append(f"rank {rank} nccl trace: none ({answer or 'empty dump'})")
    return lines
