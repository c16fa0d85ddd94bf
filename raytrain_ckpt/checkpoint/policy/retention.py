"""Which committed checkpoint steps to delete, and which step is best: pure policies, table-tested."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["KeepBest", "RetentionPolicy", "newest_certified", "rank_steps"]

ScoreMode = Literal["min", "max"]


def rank_steps(scores: Mapping[int, float | None], mode: ScoreMode) -> list[int]:
    """Steps with a score, best first: lowest (``min``) or highest (``max``) score.

    A step without a score or with a NaN one never ranks; ties go to the older step (it was
    best first, and a later equal score adds nothing).
    """
    sign = 1.0 if mode == "min" else -1.0
    scored = [(sign * v, s) for s, v in scores.items() if v is not None and not math.isnan(v)]
    return [s for _, s in sorted(scored)]


def newest_certified(recorded: Mapping[int, int | None]) -> int | None:
    """The newest certified step that the committed steps' manifests record (``recorded``: step ->
    its manifest's ``certified_step``), among the committed steps; None when none is recorded."""
    steps = [c for c in recorded.values() if c is not None and c in recorded]
    return max(steps) if steps else None


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``k`` committed steps with the best value of ``metric`` (a value recorded in
    the step's manifest: ``eval_loss`` or ``loss``), lowest first for ``min``, highest for ``max``."""

    metric: str
    mode: ScoreMode = "min"
    k: int = 1

    def best(self, metrics: Mapping[int, Mapping[str, float | None]]) -> list[int]:
        """Up to ``k`` steps of ``metrics`` (step -> its recorded values), best first."""
        return rank_steps({s: m.get(self.metric) for s, m in metrics.items()}, self.mode)[:self.k]

    def record(self) -> dict[str, Any]:
        """What a manifest records of the policy, so ``export best`` ranks the way the job did."""
        return {"metric": self.metric, "mode": self.mode, "k": self.k}


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_latest_k`` committed steps plus every step divisible by
    ``keep_every_n_steps`` plus the ``keep_best`` steps; ``keep_latest_k=None`` keeps everything.

    Never deleted whatever the settings: the newest committed step, a step still being
    written (``in_flight``), a step somebody is loading (``leased``) and the newest step the
    training guard certified (``certified``: the step a rollback returns to).
    """

    keep_latest_k: int | None
    keep_every_n_steps: int | None = None
    keep_best: KeepBest | None = None

    def to_delete(self, committed: Iterable[int], leased: Iterable[int] = (), in_flight: Iterable[int] = (),
                  metrics: Mapping[int, Mapping[str, float | None]] | None = None,
                  certified: int | None = None) -> list[int]:
        """Committed steps to delete; ``metrics`` maps a step to the values its manifest records."""
        steps = sorted(set(committed))
        if self.keep_latest_k is None or not steps:
            return []
        keep = set(steps[-max(self.keep_latest_k, 1):])
        if self.keep_every_n_steps:
            keep |= {s for s in steps if s % self.keep_every_n_steps == 0}
        if self.keep_best is not None:
            metrics = metrics or {}
            keep |= set(self.keep_best.best({s: metrics.get(s, {}) for s in steps}))
        keep |= set(leased) | set(in_flight)
        if certified is not None:
            keep.add(certified)
        return [s for s in steps if s not in keep]
