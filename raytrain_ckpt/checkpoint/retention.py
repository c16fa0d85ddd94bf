"""Which committed checkpoint steps to delete: a pure policy, table-tested."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["RetentionPolicy"]


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_latest_k`` committed steps plus every step divisible by
    ``keep_every_n_steps`` plus the ``keep_best_k`` steps of lowest eval loss;
    ``keep_latest_k=None`` keeps everything.

    Never deleted whatever the settings: the newest committed step, a step still being
    written (``in_flight``) and a step somebody is loading (``leased``). A step without an
    eval loss is never one of the best; ties go to the older step (it was best first).
    """

    keep_latest_k: int | None
    keep_every_n_steps: int | None = None
    keep_best_k: int | None = None

    def to_delete(self, committed: Iterable[int], leased: Iterable[int] = (),
                  in_flight: Iterable[int] = (), eval_losses: Mapping[int, float | None] | None = None) -> list[int]:
        steps = sorted(set(committed))
        if self.keep_latest_k is None or not steps:
            return []
        keep = set(steps[-max(self.keep_latest_k, 1):])
        if self.keep_every_n_steps:
            keep |= {s for s in steps if s % self.keep_every_n_steps == 0}
        keep |= self._best(steps, eval_losses or {})
        keep |= set(leased) | set(in_flight)
        return [s for s in steps if s not in keep]

    def _best(self, steps: list[int], eval_losses: Mapping[int, float | None]) -> set[int]:
        if not self.keep_best_k:
            return set()
        scored = [(loss, s) for s in steps if (loss := eval_losses.get(s)) is not None and loss == loss]
        return {s for _, s in sorted(scored)[:self.keep_best_k]}
