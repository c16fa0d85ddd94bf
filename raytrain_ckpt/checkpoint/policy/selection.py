"""Which committed step of a job's checkpoint root a command means: ``latest``, ``best`` or a number.

Pure: ``candidates`` ranks the steps of a root from their manifests alone; reading the root
and verifying the candidates in that order is ``interchange/steps.py``'s (``select_step``).

``best`` ranks the steps by the metric and mode of the job's ``checkpoint.keep_best``, which
every manifest written under it records (the newest manifest's record wins: it is the job's
current setting); a root without one is ranked by ``eval_loss``, lowest first, and the
selection says so.
"""

from __future__ import annotations

from collections.abc import Callable

from raytrain_ckpt.checkpoint.errors import ConversionError
from raytrain_ckpt.checkpoint.format.manifest import Manifest
from raytrain_ckpt.checkpoint.format.names import Location
from raytrain_ckpt.checkpoint.policy.retention import KeepBest, rank_steps

__all__ = ["SELECTORS", "candidates", "parse_selector"]

SELECTORS = ("latest", "best")
DEFAULT_BEST = KeepBest("eval_loss", "min")
"""How ``best`` ranks steps of a root whose manifests record no ``checkpoint.keep_best``."""


def parse_selector(text: str) -> str | int:
    """``latest``, ``best`` or a step number; raises ConversionError naming the choices."""
    if text in SELECTORS:
        return text
    if text.isascii() and text.isdigit():
        return int(text)
    raise ConversionError(f"step selector {text!r}: use latest, best or a step number")


def candidates(root: Location, manifests: dict[int, Manifest],
               selector: str | int) -> tuple[list[int], Callable[[Manifest], str]]:
    """The steps of ``manifests`` (the valid steps of ``root``, by sizes) that ``selector`` names,
    best first, and the reason a chosen one gives the user; raises ConversionError when none fits."""
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
