"""Which committed step an export reads: a step directory given (verified), or the step of a
job's checkpoint root that a selector names: the root's valid steps ranked by the pure policy
(``policy/selection.py``), then verified one at a time in that order: the first that verifies
is the answer, so a damaged best step yields the next best, never the damaged one."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from raytrain_ckpt.checkpoint.errors import ConversionError, InvalidCheckpoint, StorageUnavailable
from raytrain_ckpt.checkpoint.format.manifest import Manifest
from raytrain_ckpt.checkpoint.format.names import Location, parent_of, parse_entry
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.format.verify import Verify, verify_step
from raytrain_ckpt.checkpoint.policy.selection import candidates, parse_selector
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

logger = logging.getLogger(__name__)

__all__ = ["Selection", "named_as_given", "resolve", "resolve_step", "select_step"]


@dataclass(frozen=True)
class Selection:
    """The chosen step, its verified manifest, and why it was chosen (for the user)."""

    step_dir: Location
    manifest: Manifest
    reason: str


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
    steps, reason = candidates(root, manifests, selector)
    for step in steps:
        try:
            manifest = layout.verify(layout.step_dir(step), verify)
        except InvalidCheckpoint as exc:
            if isinstance(selector, int):  # the one step asked for: its reason is the answer
                raise ConversionError(f"{root}: step {step} does not verify ({exc}); export another step or "
                                      "latest") from None
            logger.warning("skipping checkpoint step %d: %s", step, exc)
            continue
        return Selection(layout.step_dir(step), manifest, reason(manifest))
    raise ConversionError(f"{root}: no {selector} step verifies (checked {steps}); "
                          "see raytrain-ckpt verify <step directory>")


def resolve_step(ckpt: Location, verify: Verify = "checksum", select: str | None = None) -> tuple[Location, Manifest]:
    """A step directory (verified), or the step of a job's checkpoint root (a path or a URI) that
    ``select`` names (``latest``, the default; ``best``; or a step number: see ``selection``)."""
    step_dir, manifest, _ = resolve(ckpt, verify, select)
    return step_dir, manifest


def named_as_given(path: Location) -> Path:
    """An absolute path whose last name is the one given: a step directory that is a symbolic
    link is judged by its own name (``step-00000006`` linked to step 2's directory is not step 2)."""
    p = Path(path).expanduser().absolute()
    return p.resolve() if p.name in ("", "..") else p.parent.resolve() / p.name


def resolve(ckpt: Location, verify: Verify, select: str | None) -> tuple[Location, Manifest, str]:
    """``resolve_step``'s step directory and manifest, and why that step (for the user)."""
    ckpt = str(ckpt).rstrip("/") if is_uri(ckpt) else named_as_given(ckpt)
    try:
        storage = open_storage(ckpt)
    except StorageUnavailable as exc:
        raise ConversionError(str(exc)) from None
    if not storage.is_dir(ckpt):
        raise ConversionError(f"{ckpt}: no such checkpoint; pass a step directory (.../step-00000040) "
                              "or a job's checkpoint root")
    entry = parse_entry(storage.name(ckpt))
    if entry is not None and not entry.kind.is_loadable:
        raise ConversionError(f"{ckpt} is a {entry.kind.value} entry, not a committed step (never loaded or "
                              "exported); pass a step-N directory")
    if entry is not None and select is not None:
        raise ConversionError(f"{ckpt} is a step directory; the step selector {select!r} picks among the steps of "
                              f"a job's checkpoint root: pass {parent_of(ckpt)}")
    if entry is not None:
        try:
            return ckpt, verify_step(ckpt, verify, storage), "the step given"
        except InvalidCheckpoint as exc:
            raise ConversionError(f"{ckpt} is not a valid committed checkpoint: {exc}") from None
    chosen = select_step(ckpt, parse_selector(select or "latest"), verify)
    logger.info("%s: exporting step %d, %s", ckpt, chosen.manifest.step, chosen.reason)
    return chosen.step_dir, chosen.manifest, chosen.reason
