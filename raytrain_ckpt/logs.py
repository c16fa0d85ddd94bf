"""The one log line format of raytrain_ckpt's processes (driver, CLI, training workers)."""

from __future__ import annotations

import logging

__all__ = ["LOG_FORMAT", "setup_logging"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(force: bool = False) -> None:
    """INFO to stderr in ``LOG_FORMAT``; ``force`` replaces handlers Ray's worker set up."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, force=force)
