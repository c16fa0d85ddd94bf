"""Every error of the checkpoint package that a user or another process sees, and the exit codes
of the command line, in one place.

Plain exception classes whose only argument is their one-line message (what is wrong, how to fix
it), so they pickle across Ray's process boundaries unchanged (a test round-trips each). Imports
nothing else of the package, so every room may raise them.

``USAGE_ERRORS`` are the user mistakes a run reports as one line with exit code 2.
"""

from __future__ import annotations

import enum

__all__ = ["USAGE_ERRORS", "ConversionError", "ExitCode", "StorageUnavailable"]


class ExitCode(enum.IntEnum):
    """The exit codes of ``raytrain-ckpt``: the same for every command."""

    OK = 0
    FAILED = 1
    """The job failed, or ``verify`` found a step torn or corrupt."""
    USAGE = 2
    """A user mistake: a bad spec, flag or path, a cluster that cannot hold the job; one line per problem."""
    INTERRUPTED = 130
    """``run`` stopped by Ctrl-C (SIGINT, 128 + 2); committed steps are kept."""
    STOPPED = 143
    """``run`` stopped by SIGTERM (128 + 15: `ray job stop`, a pod's end); the step in hand was saved."""


class ConversionError(ValueError):
    """A bad export or import request, or an unusable checkpoint: one line saying what and how to fix it."""


class StorageUnavailable(ValueError):
    """A checkpoint URI whose filesystem cannot be used here (package missing, unknown scheme)."""


__all__ += ["InvalidCheckpoint"]


class InvalidCheckpoint(ValueError):
    """A step directory that must not be loaded, with the reason."""


__all__ += ["StepUnreadable"]


class StepUnreadable(InvalidCheckpoint):
    """A step whose manifest this process may not read (its permissions): not loaded, and not
    called corrupt either (the fault is the reader's access, not the step)."""


__all__ += ["UnsafeCheckpoint"]


class UnsafeCheckpoint(InvalidCheckpoint):
    """A checkpoint file that asks for code to be run when read; refused, never executed."""


__all__ += ["BadEnvironment"]


class BadEnvironment(ValueError):
    """An environment variable this project reads holds a value it refuses (named, with the range).
    Never an ``InvalidCheckpoint``: a typo in a limit is not a verdict on any checkpoint."""


__all__ += ["RootInUse"]


class RootInUse(ValueError):
    """Another run of the same job is training into the same checkpoint root. A user mistake
    (exit code 2), raised before anything starts."""


__all__ += ["StorageNotShared"]


class StorageNotShared(ValueError):
    """``checkpoint.dir`` is a node-local path on a multi-node cluster: a user mistake (exit code 2)."""


__all__ += ["NotOwnFile"]


class NotOwnFile(OSError):
    """A name under a checkpoint root that this code writes is a symbolic link, another name of
    a file (a hard link: a shard, a user's file) or not a regular file: it is never written
    through, whoever planted it."""


__all__ += ["ResumeRefused"]


class ResumeRefused(ValueError):
    """``checkpoint.resume`` names a step that is missing or not intact, or that cannot start a new
    timeline now: the job cannot start where it was asked to, and starting anywhere else would hide
    it. A user mistake (exit code 2), raised before anything trains."""


__all__ += ["StepAborted"]


class StepAborted(RuntimeError):
    """A step that will never commit (a writer or the actor died, or it was aborted)."""


__all__ += ["StagingAborted"]


class StagingAborted(RuntimeError):
    """The staging copy a writer was waiting for will never complete: it failed, or the trainer died."""


__all__ += ["ReplicaError"]


class ReplicaError(RuntimeError):
    """A replica that is incomplete, does not match its checksum, or is not held here."""


__all__ += ["StagingFileError"]


class StagingFileError(RuntimeError):
    """A staging buffer's path holds something we did not create, or cannot be created."""


__all__ += ["StagingNoSpace"]


class StagingNoSpace(StagingFileError):
    """A staging buffer's memory cannot be allocated in full (the staging file system is full):
    that save fails before any trainer maps the buffer, training continues."""


__all__ += ["CheckpointMismatch"]


class CheckpointMismatch(ValueError):
    """A checkpoint whose entries do not fit this model: refused instead of loading garbage."""


__all__ += ["CopyMismatch"]


class CopyMismatch(RuntimeError):
    """An in-memory copy that must not be loaded (the caller loads from storage instead)."""


__all__ += ["ReaderGone", "TensorHeaderRefused"]


class ReaderGone(RuntimeError):
    """The sandboxed reader process gave no answer by its deadline (``timed_out``), or a malformed
    one: the decode is refused (``format/sandbox.py``) and the next decode starts a new reader."""

    def __init__(self, message: str = "", timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class TensorHeaderRefused(ValueError):
    """A tensor chunk's ``data.pkl`` that is not what ``torch.save`` writes for one tensor
    (``format/tensorblob.py``): never unpickled."""


USAGE_ERRORS: tuple[type[Exception], ...] = (RootInUse, StorageNotShared, ResumeRefused)
"""The errors a run raises for a user's mistake before anything trains: one line, exit code 2.
(``ConversionError`` and ``StorageUnavailable`` are the same for ``export``/``import``/``ls``.)"""
