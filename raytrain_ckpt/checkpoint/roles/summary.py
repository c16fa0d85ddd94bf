"""The one-line view of a CheckpointActor's status, shared by ``raytrain-ckpt status`` and a job's end.

These read the status's JSON view (``ActorStatus.to_dict``): it is what a job's result carries
(``JobResult.checkpoints``) and what ``status --json`` prints, so a saved result reads the same.
"""

from __future__ import annotations

from typing import Any

from raytrain_ckpt.checkpoint.records import StepPhase

from raytrain_ckpt.common.events import printable

__all__ = ["failed_saves_text", "phase_text", "resume_refused_text", "summary_line"]


def phase_text(phase: str, ranks: dict[int, int], world_size: int) -> str:
    """``writing 3/4 ranks``: the in-flight step's phase and how many ranks are through it."""
    values = list(ranks.values())
    done = {StepPhase.STAGING.value: sum(v >= 1 for v in values), StepPhase.WRITING.value: sum(v >= 2 for v in values)}
    n = done.get(phase, world_size if phase == StepPhase.COMMITTING.value else 0)
    return f"{phase} {n}/{world_size} ranks"


def summary_line(status: dict[str, Any]) -> str:
    """``committed=120 inflight=130 writing 3/4 ranks``: the one-line view of a CheckpointActor."""
    text = f"committed={status['latest'] if status['latest'] is not None else '-'}"
    inflight = status["inflight"]
    if inflight["step"] is None:
        return text + " inflight=-"
    phase = phase_text(inflight["phase"], inflight["ranks"], status["world_size"])
    return text + f" inflight={inflight['step']} {phase}"


def failed_saves_text(status: dict[str, Any]) -> str | None:
    """``3 save(s) failed in a row since the last commit (4 in all); the newest: step 30: <why>``,
    or None when the newest save did not fail."""
    saves = status.get("failed_saves") or {}
    if not saves.get("consecutive"):
        return None
    return printable(f"{saves['consecutive']} save(s) failed in a row since the last commit ({saves['total']} in "
                     f"all); the newest: step {saves['last_step']}: {saves['last_error']}")


def resume_refused_text(status: dict[str, Any]) -> str | None:
    """``a restart would not resume from step 30: <why>`` for the newest committed step the
    CheckpointActor's check refused (``ActorStatus.resume_refused``), or None."""
    refused = {int(s): why for s, why in (status.get("resume_refused") or {}).items()}
    if not refused:
        return None
    newest = max(refused)
    more = f" (and {len(refused) - 1} older step(s))" if len(refused) > 1 else ""
    return printable(f"a restart would not resume from step {newest}{more}: {refused[newest]}")
