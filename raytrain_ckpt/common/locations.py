"""How a location is spelled: an object-store URI or a local path, a ``~`` that cannot be
expanded, a secret inside a URI. Plain string work shared by the spec, the CLI and the
checkpoint storage; it imports nothing of raytrain_ckpt, so the spec package need not import
the checkpoint machinery to tell a URI from a path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["MANGLED_URI", "STORE_SCHEMES", "home_problem", "is_uri", "mangled_uri", "mask_uri", "uri_secrets"]

STORE_SCHEMES = ("s3", "s3a", "gs", "gcs", "memory")
"""The URI schemes a checkpoint, an export or a command's path may name (memory:// only where one
process is all there is); any other scheme is refused by name, before any filesystem is made."""


MANGLED_URI = re.compile(r"^(s3a?|gs|gcs|file):/?(?!/)", re.IGNORECASE)
"""A store's scheme with one slash or none (``s3:/bucket``, ``gs:bucket``): a URI mistyped, or
folded by ``pathlib`` (``Path("s3://b")`` is ``s3:/b``)."""


def mangled_uri(text: str) -> str | None:
    """The line a user reads when ``text`` is a store URI missing a slash (``s3:/b/x``), taken
    as written it would be a local folder named ``s3:``; None otherwise."""
    m = MANGLED_URI.match(text)
    if m is None:
        return None
    if m.group(1).lower() == "file":  # file:/x meant the absolute /x: file:///x (file://x is the relative x)
        return f"looks like a URI missing a slash; write file://{text[len('file:'):]}"
    return f"looks like a URI missing a slash; write {m.group(1)}://{text[m.end():]}"


def is_uri(root: str | os.PathLike) -> bool:
    """True for ``<scheme>://...`` other than ``file://`` (a local path in URI spelling)."""
    text = os.fspath(root)
    return "://" in text and not text.startswith("file://")


def home_problem(path: str | os.PathLike) -> str | None:
    """Why a leading ``~`` or ``~user`` of a local path cannot be expanded, as the line a user reads;
    None when it can (pathlib raises a RuntimeError deep in whatever expands it)."""
    local = Path(os.fspath(path))
    try:
        local.expanduser()
    except RuntimeError:
        first = local.parts[0]
        why = ("cannot be expanded (no HOME, and no home for this user id)" if first == "~"
               else "names no user of this machine")
        return f"{first} {why}; write the path out in full"
    return None


_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*:/{1,2})([^/@\s]+)@")  # (a Path folds :// to :/)


def mask_uri(text: str) -> str:
    """``text`` with the password (or a lone token) of every ``scheme://user:secret@host`` in it
    replaced by ``***``: what a spec error or log line may show of a URI."""
    def masked(m: re.Match[str]) -> str:
        user, sep, _ = m.group(2).partition(":")
        return f"{m.group(1)}{user}:***@" if sep else f"{m.group(1)}***@"
    return _USERINFO.sub(masked, text)


def uri_secrets(text: str) -> set[str]:
    """The passwords (or lone tokens) of every ``scheme://user:secret@host`` in ``text``: what a
    printer masks wherever it shows up, also where a library quotes the URI's parts out of it."""
    out = set()
    for m in _USERINFO.finditer(text):
        user, sep, secret = m.group(2).partition(":")
        out.add(secret if sep else user)
    return {s for s in out if s}
