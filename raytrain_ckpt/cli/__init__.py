"""The commands of ``raytrain-ckpt`` (``main.py``: the parser and ``run``/``validate``/``schema``/``export``/``import``;
the others one command family each). Runs in the user's shell; may import every other room.

``os_error_exit``: the exit code and the one line of an OS error met on a path a command was given;
``file_uris_as_paths``: the paths a command was given, as every command reads them.
"""

from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path

from raytrain_ckpt.checkpoint.errors import ExitCode

__all__ = ["file_uris_as_paths", "os_error_exit"]

_PATH_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.ELOOP})
"""What makes a given path (or a file under it) unreadable by the user's doing: no permission, a
file where a directory belongs, a link loop."""


def os_error_exit(exc: OSError, *given: object, shown: object = "") -> tuple[ExitCode, str]:
    """``(exit code, line)`` for ``exc``, met while reading the paths ``given`` on the command line.

    A name too long for the file system, or one of ``_PATH_ERRNOS`` on a given path or a file
    under it, is a user mistake (exit 2) and its line says how to fix it. Anything else (a disk
    error, a full disk, a vanished mount, a file this program needs and cannot open) is a failure
    (exit 1): never a verdict on the user's input. ``shown`` names the path when ``exc`` names none.
    """
    name = exc.filename if isinstance(exc.filename, (str, os.PathLike)) else None
    text = f"{os.fspath(name) if name is not None else shown}: {exc.strerror or exc}"
    if exc.errno == errno.ENAMETOOLONG:  # a name no file system takes: a typo
        return ExitCode.USAGE, text
    if exc.errno in _PATH_ERRNOS and name is not None and _under(name, given):
        fix = "fix its permissions" if exc.errno in (errno.EACCES, errno.EPERM) else "fix the path"
        return ExitCode.USAGE, f"{text}; {fix} or pass a path you can read"
    return ExitCode.FAILED, text


def _under(name: str | os.PathLike, given: tuple[object, ...]) -> bool:
    """Whether ``name`` is one of the local paths ``given`` or lies under one (spelled as given,
    absolute or with its links resolved)."""

    def forms(path: str | os.PathLike) -> set[str]:
        text = os.path.expanduser(os.fspath(path))
        return {os.path.abspath(text), os.path.realpath(text)}

    targets = forms(name)
    for path in given:
        if not isinstance(path, (str, os.PathLike)) or "://" in os.fspath(path):
            continue
        for base in forms(path):
            if any(t == base or t.startswith(base.rstrip(os.sep) + os.sep) for t in targets):
                return True
    return False


_PATH_ARGS = ("ckpt", "out", "file", "to", "dir", "step_dir", "step_a", "step_b", "root")
"""The arguments that name a checkpoint, a step or an output: a path or an object-store URI."""


def file_uris_as_paths(args: argparse.Namespace) -> str | None:
    """``file:///x`` on the command line is the local path ``/x``, as in a spec's checkpoint.dir:
    every check and command after this sees the path. A store URI missing a slash is refused (the
    problem), not taken as a local folder ``s3:``."""
    from raytrain_ckpt.common.locations import mangled_uri

    for name in _PATH_ARGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("file://"):
            setattr(args, name, value.removeprefix("file://"))
        elif isinstance(value, (str, Path)) and (problem := mangled_uri(str(value))):
            return f"{value}: {problem}"
    return None
