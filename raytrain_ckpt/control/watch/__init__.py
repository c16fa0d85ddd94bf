"""The controller's detectors, one module each: hangs, silent checkpoint processes, stragglers,
preemptions and drains, goodput, quarantine and node health.

Each watch the controller runs over its polls owns its own state and implements ``Watch``: it
hears of every attempt's start and says what it adds to ``status`` (the controller's summary).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Watch"]


class Watch(Protocol):
    """What the controller asks of every watch besides what it observes in a poll."""

    def new_attempt(self) -> None:
        """An attempt started: its ranks are new, measured afresh (what was reported stays)."""

    def status(self) -> dict[str, Any]:
        """What this watch adds to the job's summary (``status --job``, the bulletin)."""
