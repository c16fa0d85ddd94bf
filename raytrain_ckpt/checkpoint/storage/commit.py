"""How a step becomes durable: one object per root for "POSIX rename" vs. "manifest written last".

Like orbax's ``AtomicRenameTemporaryPath`` / ``CommitFileTemporaryPath``, the protocol is chosen
once from the root's spelling (``commit_protocol``) and owns every step of the difference:

==========================  ===========================================  ==============================================
                            ``RenameCommit`` (a path)                    ``ManifestLastCommit`` (a URI)
==========================  ===========================================  ==============================================
where a step is written     a new ``step-N.tmp-<id>`` directory          ``step-N/`` itself, cleared of a leftover
commit                      manifest fsynced, rename, parent fsynced     the manifest written last, in one PUT
committed name exists       the ``step-N`` directory                     its manifest object
never committed             ``*.tmp-*``                                  ``*.tmp-*`` and a manifest-less ``step-N/``
move aside                  one durable rename                           copy, manifest last; delete, manifest first
delete                      rename out of the namespace, then remove     manifest first (re-checked against leases)
locks                       flock'ed files (leases, the run lock)        none: order of writes, conditional writes
a small file replaced       written aside and renamed over it            one PUT
==========================  ===========================================  ==============================================

Object stores have no rename, so the same rules hold through another order of writes: a
``step-N/`` without a manifest never verifies, so it is never loaded; the manifest is deleted
first, so a crash mid-delete leaves a manifest-less leftover, never a torn step that looks
committed; a move copies every object with the manifest last and only then deletes the source,
manifest first, so a committed step is always committed under one of the two names (or both).
Without a lock, ``delete`` re-reads the leases after removing the manifest and puts the
manifest back if a lease on the step appeared (see ``leases.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import ClassVar

from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.checkpoint.format.names import Entry, EntryKind, Location, step_name
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.storage.backends import Storage
from raytrain_ckpt.checkpoint.storage.posix import fsync_dir, replace_file

logger = logging.getLogger(__name__)

__all__ = ["CommitProtocol", "ManifestLastCommit", "RenameCommit", "commit_protocol", "protocol_for"]

MoveAside = Callable[[Location], None]
"""Moves a committed-name entry that is in the way aside (the layout verifies it first)."""


class CommitProtocol:
    """The order of writes that makes a step under ``root`` valid; see the module docstring."""

    renames: ClassVar[bool]
    """Whether a directory rename is the commit (POSIX), for messages and reports."""
    file_locks: ClassVar[bool]
    """Whether the root takes flock'ed lock files (``leases/.lock`` orders taking leases against
    deleting steps; ``.run.lock`` keeps a second run out); an object store has none: the order of
    operations and conditional writes stand in."""
    local_tmp: ClassVar[bool]
    """Whether ``new_tmp`` is a local directory that a writer (DCP) fills directly; otherwise the
    files are written to a local temporary directory and put into it (``storage.put_file``)."""

    def __init__(self, storage: Storage, root: Location) -> None:
        self.storage, self.root = storage, self.spell(root)

    @staticmethod
    def spell(root: Location) -> Location:
        """The root as this protocol's locations are spelled (a ``Path``, or a URI without a trailing /)."""
        raise NotImplementedError

    def new_tmp(self, step: int, move_aside: MoveAside) -> Location:
        """A fresh, empty place to write ``step`` into."""
        raise NotImplementedError

    def is_committed(self, final: Location) -> bool:
        """Whether the committed name ``final`` (``step-N``) exists."""
        raise NotImplementedError

    def uncommitted(self, entries: list[tuple[Entry, Location]],
                    committed: Collection[int]) -> list[tuple[Entry, Location]]:
        """The entries that never committed (``committed``: steps known to have a manifest, not asked)."""
        return [(e, path) for e, path in entries if e.kind is EntryKind.TMP]

    def commit(self, tmp: Location, final: Location, manifest: Manifest, move_aside: MoveAside) -> Location:
        """Make ``tmp`` the committed ``final`` with ``manifest``; returns ``final``."""
        raise NotImplementedError

    def move(self, src: Location, dst: Location) -> None:
        """Move a step entry to another name, durably."""
        raise NotImplementedError

    def delete(self, step: int, final: Location, still_doomed: Callable[[], bool] | None) -> bool:
        """Remove committed ``final``; returns whether it was deleted."""
        raise NotImplementedError

    def same_path(self, a: str, b: Location) -> bool:
        """Whether ``a`` (a path as given, e.g. a resume point's) names the entry ``b`` of this root."""
        raise NotImplementedError

    def replace_small_file(self, path: Location, data: bytes) -> None:
        """Replace a small file under the root whole: a reader sees the old or the new bytes."""
        raise NotImplementedError


class RenameCommit(CommitProtocol):
    """POSIX: write a temporary directory, fsync the manifest last, rename it to ``step-N``, fsync the parent."""

    renames = True
    file_locks = True
    local_tmp = True

    @staticmethod
    def spell(root: Location) -> Location:
        return Path(root)

    def new_tmp(self, step: int, move_aside: MoveAside) -> Location:
        self.storage.makedirs(self.root)
        path = self.storage.join(self.root, step_name(step, EntryKind.TMP, uuid.uuid4().hex[:12]))
        Path(path).mkdir()
        return path

    def is_committed(self, final: Location) -> bool:
        return self.storage.is_dir(final)

    def commit(self, tmp: Location, final: Location, manifest: Manifest, move_aside: MoveAside) -> Location:
        mpath = Path(tmp) / MANIFEST
        with open(mpath, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(Path(tmp))
        final = Path(final)
        if final.exists() or final.is_symlink():
            move_aside(final)
        os.rename(tmp, final)
        fsync_dir(Path(self.root))
        return final

    def move(self, src: Location, dst: Location) -> None:
        os.rename(src, dst)
        fsync_dir(Path(self.root))

    def delete(self, step: int, final: Location, still_doomed: Callable[[], bool] | None) -> bool:
        """Rename out of the step namespace first (durably), so a crash mid-delete leaves no torn
        step-N, only a ``.tmp-`` entry that the next start removes. ``still_doomed`` is not asked:
        callers hold the lease lock instead."""
        doomed = Path(final).with_name(step_name(step, EntryKind.TMP, uuid.uuid4().hex[:12]))
        os.rename(final, doomed)
        fsync_dir(Path(self.root))
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def same_path(self, a: str, b: Location) -> bool:
        return Path(a).resolve() == Path(b).resolve()

    def replace_small_file(self, path: Location, data: bytes) -> None:
        replace_file(Path(path), data)


class ManifestLastCommit(CommitProtocol):
    """Object store: the objects written in place under ``step-N/``, the manifest last, in one PUT."""

    renames = False
    file_locks = False
    local_tmp = False

    @staticmethod
    def spell(root: Location) -> Location:
        return str(root).rstrip("/")

    def new_tmp(self, step: int, move_aside: MoveAside) -> Location:
        """``step-N/`` itself, cleared of an uncommitted leftover; a torn committed step-N is
        moved aside first and a valid one is never written into (``move_aside`` raises)."""
        final = self.storage.join(self.root, step_name(step))
        if self.is_committed(final):
            move_aside(final)
        elif self.storage.is_dir(final):
            if not self._surely_uncommitted(final):  # never written into: it may be a committed step
                raise OSError(f"{final}: could not tell whether it holds a committed step; this save of step "
                              f"{step} is not written (the next save asks again)")
            logger.warning("removing uncommitted leftover %s before writing step %d", final, step)
            self.storage.remove_tree(final)
        return final

    def is_committed(self, final: Location) -> bool:
        return self.storage.is_file(self.storage.join(final, MANIFEST))

    def uncommitted(self, entries: list[tuple[Entry, Location]],
                    committed: Collection[int]) -> list[tuple[Entry, Location]]:
        return super().uncommitted(entries, committed) + [
            (e, path) for e, path in entries
            if e.kind.is_loadable and e.step not in committed and not self.is_committed(path)
            and self._surely_uncommitted(path)]

    def _surely_uncommitted(self, final: Location) -> bool:
        """``step-N/`` has no manifest, by an answer of the store, not by a failed request: a
        prefix is deleted as a leftover only then (a committed step is never deleted for a 503)."""
        absent = getattr(self.storage, "surely_absent", None)
        try:
            return absent is None or absent(self.storage.join(final, MANIFEST))
        except Exception as exc:  # noqa: BLE001 - unknown: kept (a later start or save looks again)
            logger.warning("%s kept: could not tell whether it is committed (%s)", final, exc)
            return False

    def commit(self, tmp: Location, final: Location, manifest: Manifest, move_aside: MoveAside) -> Location:
        assert str(tmp) == str(final), (tmp, final)  # new_tmp hands out step-N itself
        mpath = self.storage.join(final, MANIFEST)
        if self.storage.is_file(mpath):
            raise FileExistsError(f"{final} was committed by another save meanwhile; never overwritten")
        self.storage.write_bytes(mpath, manifest.to_json().encode("utf-8"))
        return final

    def move(self, src: Location, dst: Location) -> None:
        """Copy every object, the manifest last, then delete the source, manifest first."""
        names = self.storage.listdir(src)
        for name in sorted(names, key=lambda n: n == MANIFEST):
            self.storage.copy_file(self.storage.join(src, name), self.storage.join(dst, name))
        self.storage.remove_file(self.storage.join(src, MANIFEST))
        self.storage.remove_tree(src)

    def delete(self, step: int, final: Location, still_doomed: Callable[[], bool] | None) -> bool:
        """The manifest first, then the objects. ``still_doomed`` is asked after the manifest is
        gone: False (a lease on the step appeared) puts the same manifest back and keeps the step."""
        if not self.storage.is_dir(final):
            raise FileNotFoundError(final)
        mpath = self.storage.join(final, MANIFEST)
        body = self.storage.read_bytes(mpath) if still_doomed is not None and self.storage.is_file(mpath) else None
        self.storage.remove_file(mpath)
        if still_doomed is not None and not still_doomed():
            if body is not None:
                self.storage.write_bytes(mpath, body)
            logger.warning("step %d was leased while being deleted: its manifest is back, the step is kept", step)
            return False
        self.storage.remove_tree(final)
        return True

    def same_path(self, a: str, b: Location) -> bool:
        return a.rstrip("/") == str(b).rstrip("/")

    def replace_small_file(self, path: Location, data: bytes) -> None:
        self.storage.write_bytes(path, data)  # one PUT replaces the object atomically


def protocol_for(root: Location) -> type[CommitProtocol]:
    """The commit protocol of a root, from its spelling alone (nothing is opened)."""
    return ManifestLastCommit if is_uri(root) else RenameCommit


def commit_protocol(root: Location, storage: Storage) -> CommitProtocol:
    """The commit protocol of ``root`` on ``storage`` (the one ``open_storage(root)`` gives)."""
    return protocol_for(root)(storage, root)
