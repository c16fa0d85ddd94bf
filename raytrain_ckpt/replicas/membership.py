"""The membership rule: which replica groups train each step (pure; one rank's view).

A group that is missing from the quorum of step ``s`` (a committed step; it failed, and its
processes are gone) is out of steps ``s .. s+H`` and trains again from ``s+H+1``, where ``H`` is
``fault_tolerance.heal_steps``: at ``s+H`` its replacement joins the quorum and torchft heals it
from a live group (its share of that step is still skipped: torchft's healing replica adds zeros),
and from ``s+H+1`` on it trains its share. The rule is fixed by the fault, not by the clock:

- a step's quorum that holds a group the rule does not expect (one that came back early), or that
  lacks one the rule expects back at that step (it was not there in time), is never committed:
  the step is redone, with the same data, until the quorum is what the rule says;
- at the attempt's first step every group is expected: a group missing there is late, not failed.

So a replay of the same fault trace commits every step with the same groups, skips the same
samples, and ends bit-identical. ``skipped`` records each committed step's absent groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Membership"]


@dataclass
class Membership:
    """``replicas`` groups and ``heal_steps`` (H)."""

    replicas: int
    heal_steps: int
    first_step: int | None = None
    """The attempt's first step (1-based; set by the first ``judge``): every group is expected there."""
    back: dict[int, int] = field(default_factory=dict)
    """Absent group -> the step its replacement joins the quorum at (``s+H``)."""
    skipped: list[tuple[int, int]] = field(default_factory=list)
    """(step, group) of every committed step a group's share was not trained in, in order."""

    def expected(self, step: int) -> set[int]:
        """The groups step ``step``'s quorum must hold."""
        return {g for g in range(self.replicas) if self.back.get(g, 0) <= step}

    def rejoining(self, step: int) -> list[int]:
        """The groups whose replacement joins at ``step`` (the healthy groups meet it first)."""
        return sorted(g for g, b in self.back.items() if b == step)

    def judge(self, step: int, present: set[int]) -> str | None:
        """Whether step ``step`` may commit with the groups ``present`` in its quorum: None, or why
        not (the step is then redone). A group newly missing opens its absence here."""
        if self.first_step is None:
            self.first_step = step
        expected = self.expected(step)
        early = present - expected
        if early:
            return f"replica group(s) {sorted(early)} joined before their rejoin step"
        late = {g for g in expected - present if self.back.get(g) == step or step == self.first_step}
        if late:
            return f"replica group(s) {sorted(late)} expected at step {step} are not in its quorum yet"
        for g in expected - present:
            self.back[g] = step + self.heal_steps
        return None

    def committed(self, step: int, present: set[int]) -> list[int]:
        """Step ``step`` committed with ``present``: record and return the groups whose share it skipped."""
        out = sorted(g for g in range(self.replicas) if g not in present or self.back.get(g) == step)
        self.skipped += [(step, g) for g in out]
        for g in [g for g, b in self.back.items() if b <= step and g in present]:
            del self.back[g]
        return out

    def state(self) -> dict[str, Any]:
        """What a replacement receives with its heal (it then judges the same way)."""
        return {"back": dict(self.back), "skipped": list(self.skipped)}

    def load(self, state: dict[str, Any], step: int) -> None:
        """A heal's ``state`` (``state()`` of a live group); ``step``: the step this group heals at."""
        self.back = {int(g): int(b) for g, b in state["back"].items()}
        self.skipped = [(int(s), int(g)) for s, g in state["skipped"]]
        self.first_step = step
