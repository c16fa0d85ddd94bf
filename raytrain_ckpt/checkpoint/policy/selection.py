"""Which committed step of a job's checkpoint root a command means: ``latest``, ``best`` or a number.

``best`` ranks the steps by the metric and mode of the job's ``checkpoint.keep_best``, which
every manifest written under it records (the newest manifest's record wins: it is the job's
current setting); a root without one is ranked by ``eval_loss``, lowest first, and the
selection says so. Candidates are ranked on their manifests (sizes checked, cheap), then
verified one at a time in that order: the first that verifies is the answer, so a damaged best
step yields the next best, never the damaged one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from raytrain_ckpt.checkpoint.interchange.formats import ConversionError
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout, Verify
from raytrain_ckpt.checkpoint.storage.backends import Location
from raytrain_ckpt.checkpoint.format.manifest import InvalidCheckpoint, Manifest
from raytrain_ckpt.checkpoint.policy.retention import KeepBest, rank_steps

logger = logging.getLogger(__name__)

__all__ = ["SELECTORS", "Selection", "parse_selector", "select_step"]

SELECTORS = ("latest", "best")
DEFAULT_BEST = KeepBest("eval_loss", "min")
"""How ``best`` ranks steps of a root whose manifests record no ``checkpoint.keep_best``."""


@dataclass(frozen=True)
class Selection:
    """The chosen step, its verified manifest, and why it was chosen (for the user)."""

    step_dir: Location
    manifest: Manifest
    reason: str


def parse_selector(text: str) -> str | int:
    """``latest``, ``best`` or a step number; raises ConversionError naming the choices."""
    if text in SELECTORS:
        return text
    if text.isascii() and text.isdigit():
        return int(text)
    raise ConversionError(f"step selector {text!r}: use latest, best or a step number")


def select_step(root: Location, selector: str | int, verify: Verify) -> Selection:
    """The step of ``root`` that ``selector`` names, verified at ``verify``.

    Raises:
        ConversionError: No valid committed step, no step recording the ranking metric, or a
            step number that is not a valid committed step.
    """
    layout = CheckpointLayout(root)
    manifests = layout.valid_steps("size")
    if not manifests:
        raise ConversionError(f"{root}: no valid committed step-N directory in it; pass a step directory "
                              "or a job's checkpoint root")
    candidates, reason = _candidates(root, manifests, selector)
    for step in candidates:
        try:
            manifest = layout.verify(layout.step_dir(step), verify)
        except InvalidCheckpoint as exc:
            if isinstance(selector, int):  # the one step asked for: its reason is the answer
                raise ConversionError(f"{root}: step {step} does not verify ({exc}); export another step or "
                                      "latest") from None
            logger.warning("skipping checkpoint step %d: %s", step, exc)
            continue
        return Selection(layout.step_dir(step), manifest, reason(manifest))
    raise ConversionError(f"{root}: no {selector} step verifies (checked {candidates}); "
                          "see raytrain-ckpt verify <step directory>")


def _candidates(root: Location, manifests: dict[int, Manifest],
                selector: str | int) -> tuple[list[int], Callable[[Manifest], str]]:
    if selector == "latest":
        return sorted(manifests, reverse=True), lambda m: "the newest valid step"
    if isinstance(selector, int):
        if selector not in manifests:
            raise ConversionError(f"{root}: step {selector} is not a valid committed step; committed steps whose "
                                  f"sizes check: {sorted(manifests)}")
        return [selector], lambda m: f"step {selector}"
    policy, note = _ranking(manifests)
    ranked = rank_steps({s: m.metrics()[policy.metric] for s, m in manifests.items()}, policy.mode)
    if not ranked:
        raise ConversionError(f"{root}: no valid committed step records {policy.metric}{note}, so none is best; "
                              f"export latest or a step number (valid steps: {sorted(manifests)})")
    return ranked, lambda m: (f"the best valid step by {policy.metric} ({policy.mode}): "
                              f"{m.metrics()[policy.metric]:.6g} of {len(ranked)} ranked{note}")


def _ranking(manifests: dict[int, Manifest]) -> tuple[KeepBest, str]:
    record = manifests[max(manifests)].keep_best
    if record is not None:
        return KeepBest(record.metric, record.mode, record.k), ""
    return DEFAULT_BEST, "; the job recorded no checkpoint.keep_best, so eval_loss (min) is used"
