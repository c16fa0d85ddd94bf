"""A rank's committed in-memory copy: the staging buffer that still holds the newest committed step.

A save leaves the rank's state in its staging buffer on the node (``/dev/shm``, owned by the
node's CheckpointWriter). With ``checkpoint.memory_copies: 2`` each rank stages into two
buffers in turn and never into the one holding the newest committed step, so that step's
bytes stay intact until a newer step commits. A restart whose layout is unchanged then loads
each rank's shard from that buffer instead of reading storage.

Nothing is loaded on trust. The writer records, when it writes a step from a buffer, the
buffer's CRC-32C and the size and CRC-32C of every file it wrote from it (``CommittedCopy``).
The driver takes the copy for a rank only when its step is the resume step and its files are
the files the step's manifest lists (``choose_sources``, a pure decision); the rank then
checksums the buffer again before it reads a byte (``open_copy``), so a buffer overwritten,
half restaged or corrupted since is refused. Ranks agree collectively: one rank refusing its
copy sends every rank to storage (``restore``), since a DCP load is a collective.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from raytrain_ckpt.checkpoint.format.verify import Verify, verify_step
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.manifest import checksum_view
from raytrain_ckpt.checkpoint.datapath.staging import copy_bytes, layout_key, map_whole, plan_slots, views_of
from raytrain_ckpt.checkpoint.recovery.state import apply_own_state, load_app_state, own_state
from raytrain_ckpt.checkpoint.format.names import Location
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.common.faults import planned
from raytrain_ckpt.checkpoint.records import CommittedCopy
from raytrain_ckpt.checkpoint.errors import CopyMismatch

logger = logging.getLogger(__name__)

__all__ = ["CopyFacts", "RankSource", "Restored", "choose_sources",
           "open_copy", "restore"]


@dataclass(frozen=True)
class CopyFacts:
    """What the driver knows about one rank's copy before the attempt starts."""

    rank: int
    copy: CommittedCopy | None
    unavailable: str | None = None
    """Why the rank's writer could not be asked (dead, unreachable); None when it answered."""


@dataclass(frozen=True)
class RankSource:
    """Where one rank loads the resume step from, and why."""

    rank: int
    source: Literal["memory", "storage"]
    why: str
    copy: CommittedCopy | None = None


def choose_sources(step: int, world_size: int, saved_world_size: int, memory_copies: int,
                   facts: list[CopyFacts], manifest_files: dict[str, dict[str, int]] | None) -> list[RankSource]:
    """Memory or storage for every rank (pure). All ranks use memory or none does: a storage load is a collective.

    ``manifest_files``: the resume step's files (name -> {"size", "crc32c"}) from its manifest;
    None for a step held only in memory (a preemption's RAM tier): nothing on storage to match,
    the copy's CRC-32C, checked on the rank, is its proof.
    """
    job_wide = _job_wide(step, world_size, saved_world_size, memory_copies)
    if job_wide is not None:
        return [RankSource(f.rank, "storage", job_wide) for f in facts]
    own = [_own_source(step, f, manifest_files) for f in facts]
    refused = next((s for s in own if s.source == "storage"), None)
    if refused is None:
        return own
    return [RankSource(s.rank, "storage", f"rank {refused.rank}: {refused.why}") for s in own]


def _job_wide(step: int, world_size: int, saved_world_size: int, memory_copies: int) -> str | None:
    if memory_copies < 2:
        return "checkpoint.memory_copies=1 keeps no committed copy in memory"
    if saved_world_size != world_size:
        return f"step {step} was saved at world size {saved_world_size}, this attempt runs {world_size}"
    return None


def _own_source(step: int, f: CopyFacts, manifest_files: dict[str, dict[str, int]] | None) -> RankSource:
    def storage(why: str) -> RankSource:
        return RankSource(f.rank, "storage", why)

    if f.unavailable is not None:
        return storage(f"its node's writer cannot be asked ({f.unavailable})")
    c = f.copy
    if c is None:
        return storage(f"its node's writer holds no copy of step {step} (a restarted writer, or the rank moved node)")
    if c.step != step:
        return storage(f"stale copy: it holds step {c.step}, the resume step is {step}")
    if c.rank != f.rank:
        return storage(f"the copy is rank {c.rank}'s")
    if manifest_files is None:
        return RankSource(f.rank, "memory", f"RAM-tier copy of step {step} in {c.path}", c)
    for name, entry in c.files.items():
        listed = manifest_files.get(name)
        if listed is None or (listed.get("size"), listed.get("crc32c")) != (entry["size"], entry["crc32c"]):
            return storage(f"the copy's file {name} is not the one step {step}'s manifest lists")
    if not c.files:
        return storage("the copy records no written files to match against the manifest")
    return RankSource(f.rank, "memory", f"copy of step {step} in {c.path}", c)


# --- trainer side ----------------------------------------------------------------------------


@dataclass
class _Opened:
    copy: CommittedCopy
    views: dict[str, torch.Tensor]
    checksum_s: float = 0.0


def open_copy(copy: CommittedCopy, step: int, rank: int, attempt: int = 0) -> _Opened:
    """Check ``copy`` is rank ``rank``'s step ``step`` byte for byte and map it; raises CopyMismatch.

    The buffer is checksummed here, on the rank, right before loading: whatever happened to
    it since the writer recorded the copy (a staging copy begun and cut off, a flipped bit)
    shows as a mismatch.
    """
    if (copy.step, copy.rank) != (step, rank):
        raise CopyMismatch(f"the copy is rank {copy.rank}'s step {copy.step}, not rank {rank}'s step {step} (stale)")
    path = Path(copy.path)
    if planned("corrupt", "restore", rank, step, attempt):
        _flip_a_byte(path, copy.nbytes)
    t0 = time.monotonic()
    try:
        size = path.stat().st_size
        whole = map_whole(path, copy.nbytes) if size == copy.nbytes else None
        crc = checksum_view(whole) if whole is not None else None
        views = views_of(whole, copy.slots) if whole is not None and crc == copy.crc32c else {}
    except OSError as exc:  # StagingFileError is a RuntimeError: both mean the buffer is not usable
        raise CopyMismatch(f"{path} cannot be read: {exc}") from None
    except RuntimeError as exc:
        raise CopyMismatch(str(exc)) from None
    if crc is None:
        raise CopyMismatch(f"{path} holds {size} bytes, the copy of step {step} was {copy.nbytes}")
    if crc != copy.crc32c:
        raise CopyMismatch(f"{path}: CRC-32C {crc:08x}, the copy of step {step} recorded {copy.crc32c:08x} "
                           "(overwritten or corrupted since)")
    return _Opened(copy, views, time.monotonic() - t0)


def _flip_a_byte(path: Path, nbytes: int) -> None:
    """The ``corrupt@restore`` fault: one bit of the buffer flips, as a bad DIMM would do."""
    with open(path, "r+b") as f:
        f.seek(nbytes // 2)
        b = f.read(1)
        f.seek(nbytes // 2)
        f.write(bytes([b[0] ^ 0x01]))
    logger.warning("injected fault: flipped a bit of %s at offset %d", path, nbytes // 2)


@dataclass
class _Prepared:
    """A verified copy matched to the trainer's own state dict, ready to be copied in."""

    sd: dict[str, Any]
    keys: Any
    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    mappings: dict[str, Any]
    views: dict[str, torch.Tensor]
    checksum_s: float


def _prepare(trainer: Any, copy: CommittedCopy, step: int, attempt: int) -> _Prepared:
    """Verify the copy (``open_copy``) and that it fits the trainer's state; changes nothing."""
    opened = open_copy(copy, step, trainer.rank, attempt)
    sd, keys = own_state(trainer, fill=False)  # the copy overwrites every tensor
    planner = DefaultSavePlanner()  # the save's flattening, so keys and layout match the copy's
    planner.set_up_planner(sd, is_coordinator=False)
    flat = planner.state_dict
    tensors = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in flat.items()
               if isinstance(v, torch.Tensor)}
    slots, _ = plan_slots(tensors)
    if layout_key(slots, [k for k in flat if k not in tensors]) != copy.layout:
        raise CopyMismatch("the copy's layout differs from this rank's state (another model or layout)")
    objects = pickle.loads(copy.objects)
    if int(objects.get("train.step", -1)) != step:
        raise CopyMismatch(f"the copy's state says step {objects.get('train.step')}, not {step} (stale)")
    return _Prepared(sd, keys, tensors, objects, planner.mappings, opened.views, opened.checksum_s)


def _apply(trainer: Any, p: _Prepared) -> float:
    """Copy the buffer into the state and apply it; returns the seconds the copy took."""
    t0 = time.monotonic()
    copy_in([(dst, p.views[fqn]) for fqn, dst in p.tensors.items()])
    copy_s = time.monotonic() - t0
    for fqn, value in p.objects.items():
        set_element(p.sd, p.mappings[fqn], value)
    apply_own_state(trainer, p.sd, p.keys)
    return copy_s


_PIECE_BYTES = 8 << 20
"""The copy into the state is cut into pieces of this size, shared out among the threads."""
_COPY_THREADS = 4


def copy_in(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``copy_bytes(dst, src)`` for every pair, on up to ``_COPY_THREADS`` threads (at most the CPUs
    this process may run on). The destinations of a restarted process are fresh pages: the copy
    is their first touch, and page faults on several threads run side by side (ARCHITECTURE,
    "A load from memory copies on several threads")."""
    threads = min(_COPY_THREADS, len(os.sched_getaffinity(0)))
    pieces = []
    with torch.no_grad():
        for dst, src in pairs:
            if threads == 1 or dst.numel() * dst.element_size() <= _PIECE_BYTES or not dst.is_contiguous():
                pieces.append((dst, src))
                continue
            step = max(1, _PIECE_BYTES // dst.element_size())
            flat_dst, flat_src = dst.view(-1), src.reshape(-1)
            pieces.extend((flat_dst[i:i + step], flat_src[i:i + step]) for i in range(0, flat_dst.numel(), step))
        if threads == 1:
            for dst, src in pieces:
                copy_bytes(dst, src)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="copy-in") as pool:
            for done in [pool.submit(_copy_piece, dst, src) for dst, src in pieces]:
                done.result()


def _copy_piece(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        copy_bytes(dst, src)


@dataclass(frozen=True)
class Restored:
    """How a rank's resume went: ``source`` is ``memory`` or ``storage``, ``why`` says why."""

    source: Literal["memory", "storage"]
    why: str
    seconds: float
    """From the moment every rank is ready to load (a barrier) to this rank's state being loaded."""
    verify_s: float = 0.0
    """The part spent checking the in-memory copy (checksum, layout) and agreeing on it."""
    checksum_s: float = 0.0
    """The part of ``verify_s`` spent mapping and checksumming this rank's buffer."""
    read_s: float = 0.0
    """The bytes' part: checksumming and copying the buffer (memory), or ``dcp.load`` (storage);
    the rest (the state dicts built and applied) is the same work on both paths."""


def restore(trainer: Any, path: str, step: int, same_world_size: bool, copy: CommittedCopy | None,
            why: str, attempt: int, verify: Verify = "size",
            refused: Callable[[], None] = lambda: None) -> Restored:
    """Load the resume step ``step`` (collective): from every rank's in-memory copy when the driver
    handed each rank one and every rank verifies its own, else from storage at ``path``.

    The driver verified storage only up to ``size`` when it handed out copies; falling back to
    storage from there, rank 0 first verifies the step to ``verify`` (``verify_on_load``) and no
    rank loads a step that fails (InvalidCheckpoint: the attempt fails, and the next one, offered
    no copy, skips the step). ``refused`` runs when this rank refuses its copy (the writer forgets it).
    """
    dist.barrier()  # load_s is the load's own time, not the wait for a rank still building its model
    t0 = time.monotonic()
    prepared, own_why = None, why
    if copy is not None:
        try:
            prepared = _prepare(trainer, copy, step, attempt)
        except CopyMismatch as exc:
            refused()
            own_why = f"rank {trainer.rank}'s copy refused: {exc}"
            logger.warning("rank %d: in-memory copy of step %d refused, loading from storage: %s",
                           trainer.rank, step, exc)
    agreed = copy is not None and _everyone(prepared is not None, trainer.device)
    verify_s = time.monotonic() - t0
    if agreed:
        assert prepared is not None
        copy_s = _apply(trainer, prepared)
        return Restored("memory", own_why, time.monotonic() - t0, verify_s, prepared.checksum_s,
                        prepared.checksum_s + copy_s)
    if copy is not None and prepared is not None:
        own_why = "another rank's copy was refused"
    if not path:
        raise InvalidCheckpoint(f"step {step} was held only in memory, a rank's copy was refused ({own_why}) "
                                "and nothing is committed on storage to fall back to")
    if copy is not None and verify != "size":  # storage was checked only up to sizes
        problem = _storage_problem(path, verify) if trainer.rank == 0 else None
        if not _everyone(problem is None, trainer.device):
            raise InvalidCheckpoint(f"step {step} cannot be loaded from memory or storage: "
                                    f"{problem or 'rank 0 found it damaged'}")
    read_s = load_app_state(trainer, path, same_world_size)
    return Restored("storage", own_why, time.monotonic() - t0, verify_s, 0.0, read_s)


def _storage_problem(path: str, verify: Verify) -> str | None:
    location: Location = path if is_uri(path) else Path(path)
    try:
        verify_step(location, verify, open_storage(location))
    except InvalidCheckpoint as exc:
        return str(exc)
    return None


def _everyone(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
