"""The one log line format of raytrain_ckpt's processes (driver, CLI, training workers)."""

from __future__ import annotations

import logging

from raytrain_ckpt.locations import mask_uri

__all__ = ["LOG_FORMAT", "MaskSecrets", "setup_logging"]

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
