"""Bounded retries of an object-store operation that failed with a transient error (throttling,
a server error, a dropped connection)."""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from raytrain_ckpt.checkpoint.errors import StorageUnavailable

logger = logging.getLogger(__name__)

__all__ = ["BACKOFF_S", "RETRIES", "is_transient", "retry_transient"]

_T = TypeVar("_T")

RETRIES = 5
"""Attempts of one object-store operation on a transient error, beyond the client's own retries."""
BACKOFF_S = 0.2
"""First backoff; doubles each retry, with jitter."""
_TRANSIENT_WORDS = ("SlowDown", "reduce your request rate", "Throttl", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500",
                    "502", "504", "reset", "Connection", "timed out", "Timeout")


_TRANSIENT_ERRNOS = (errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE)
"""s3fs translates SlowDown to EBUSY; the others are dropped or stalled connections."""


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: server errors, throttling, dropped connections, timeouts (the
    exception or what caused it: fsspec wraps the client's errors)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, StorageUnavailable)):
        return False
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        text = f"{type(exc).__name__} {exc}"
        if any(word in text for word in _TRANSIENT_WORDS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def retry_transient(fn: Callable[[], _T], what: str, on_retry: Callable[[BaseException], None] | None = None,
                    retries: int = RETRIES, backoff_s: float = BACKOFF_S,
                    transient: Callable[[BaseException], bool] = is_transient) -> _T:
    """``fn()``, retried with exponential backoff while it fails with a ``transient`` error."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == retries or not transient(exc):
                raise
            delay = backoff_s * (2 ** attempt) * (0.5 + random.random())
            logger.warning("%s: transient error (%s), retry %d/%d in %.2fs", what, exc, attempt + 1, retries, delay)
            if on_retry is not None:
                on_retry(exc)
            time.sleep(delay)
    raise AssertionError("unreachable")
