"""Bad nodes out: a node whose ranks crashed or hung twice within ``fault_tolerance.failure_window_s``
gets no rank for ``fault_tolerance.quarantine_s`` while other capacity exists.

The worker group tells the quarantine which node a failed rank ran on (``note``); placing the next
group, it asks which nodes to keep out (``excluded``) and turns that into a Ray label selector on
the node id (``selector``). Pure bookkeeping: no Ray here (the group places).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

__all__ = ["NODE_ID_LABEL", "Quarantine"]

NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node: its node id (the placement group's label selectors match on it)."""
STRIKES = 2


@dataclass
class Quarantine:
    """The failures seen per node and the nodes kept out, with the time each one comes back."""

    quarantine_s: float | None
    """None: never quarantine."""
    window_s: float | None
    """Failures count within this window (None: over the whole job)."""
    failures: dict[str, list[float]] = field(default_factory=dict)
    until: dict[str, float] = field(default_factory=dict)
    """Node id -> when (the clock's time) it may get a rank again."""

    def note(self, node: str, now: float) -> bool:
        """A rank on ``node`` crashed or hung at ``now``; True when this puts the node in quarantine."""
        if self.quarantine_s is None:
            return False
        times = [t for t in self.failures.get(node, []) if self.window_s is None or now - t <= self.window_s]
        times.append(now)
        self.failures[node] = times
        if len(times) < STRIKES or self.until.get(node, 0.0) > now:
            return False
        self.until[node] = now + self.quarantine_s
        return True

    def rank_failed(self, kind: str, rank: int, node: str, now: float) -> str | None:
        """A rank on ``node`` failed (``kind``): a crash or a hang counts against the node; the line
        to report when that puts it in quarantine (``fault_tolerance.quarantine_s``), else None."""
        if kind not in ("crash", "hang") or not self.note(node, now):
            return None
        return (f"node {node} quarantined for {self.quarantine_s:g}s (fault_tolerance.quarantine_s): its "
                f"ranks failed {len(self.failures[node])} times, the latest rank {rank} ({kind})")

    def put_out(self, node: str, now: float) -> None:
        """Quarantine ``node`` now (it failed its health probe)."""
        if self.quarantine_s is not None:
            self.until[node] = now + self.quarantine_s

    def excluded(self, now: float) -> list[str]:
        """The nodes in quarantine at ``now``, sorted."""
        return sorted(n for n, t in self.until.items() if t > now)

    def selector(self, now: float, bundles: int) -> list[dict[str, str]] | None:
        """The placement group's ``bundle_label_selector`` keeping every bundle off the quarantined
        nodes (None: none is quarantined)."""
        out = self.excluded(now)
        if not out:
            return None
        return [{NODE_ID_LABEL: f"!in({', '.join(out)})"} for _ in range(bundles)]
