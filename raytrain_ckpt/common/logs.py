"""The one log line format of raytrain_ckpt's processes (driver, CLI, training workers)."""

from __future__ import annotations

import logging
import sys

from raytrain_ckpt.common.locations import mask_uri

__all__ = ["LOG_FORMAT", "RAY_ACTOR_NAME_LINE", "MaskSecrets", "rename_log_prefix", "setup_logging"]

RAY_ACTOR_NAME_LINE = ":actor_name:"
"""The line an actor process writes to its stdout and stderr to name itself in the prefix Ray puts
on its log lines (``(NAME pid=...)``): Ray writes ``repr(actor)`` once, when the actor starts, and
its log monitor takes every later such line as the new name (``ray_constants.LOG_PREFIX_ACTOR_NAME``)."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(force: bool = False) -> None:
    """INFO to stderr in ``LOG_FORMAT``: every process of a job calls this, and nothing else
    configures logging.

    Without ``force`` a root logger that already has handlers is left as it is: pytest's
    capture, a notebook's or an embedding application's own setup win, also over an actor class
    driven directly in that process. Ray's actor processes start with no root handler (Ray
    logs through its own ``ray`` logger), so the CheckpointActor and the writers get this
    format without ``force``. ``force=True`` replaces any handler already there, for a process
    that must log in this format whatever ran before it (the training worker).
    """
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, force=force)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, MaskSecrets) for f in handler.filters):
            handler.addFilter(MaskSecrets())


class MaskSecrets(logging.Filter):
    """Masks the secret of every ``scheme://user:secret@host`` in a log line (``mask_uri``): a
    checkpoint root or data path given with credentials is logged by the driver, the storage and
    the CLI, never its password."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "@" in message:
            masked = mask_uri(message)
            if masked != message:
                record.msg, record.args = masked, None
        return True


def rename_log_prefix(name: str) -> None:
    """From now on Ray prefixes this actor process's log lines with ``name`` (a warm spare that
    took over a rank). The Ray dashboard's Actors page keeps the repr the actor started with: the
    GCS records it once, at creation. Outside a Ray actor nothing is written."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"{RAY_ACTOR_NAME_LINE}{name}\n")
        stream.flush()
