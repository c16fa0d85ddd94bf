"""The calls a group's start makes to its ranks (locate, assign, join, set up), each bounded by the
start's deadline: a failure or a timeout is a ``GroupStartError`` naming what was asked, with the
ranks not done yet (a peer's echo of theirs is then told apart)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from raytrain_ckpt.common.events import headline
from raytrain_ckpt.control.poll import GroupStartError
from raytrain_ckpt.rank.worker import WorkerFailure

__all__ = ["StartCalls"]


class StartCalls:
    """What the start asks its ranks, within ``fault_tolerance.start_timeout_s``."""

    def __init__(self, start_timeout_s: float) -> None:
        self.start_timeout_s = start_timeout_s

    def get_all(self, refs: list[ray.ObjectRef], deadline: float, what: str) -> None:
        """Every rank's ``refs[rank]``, in the order they finish: the first failure raises at once
        (a rank that cannot join leaves the others waiting in the rendezvous until the deadline).
        A failure names the ranks not done yet too: it may be a peer's echo of theirs (rank 0's
        rendezvous timing out on a rank that never arrived)."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise self.timed_out(what.format(rank=_ranks(pending.values())))
            done = {ref: pending.pop(ref) for ref in ready}
            late = f" (rank {_ranks(pending.values())} not done yet)" if pending else ""
            for ref, rank in done.items():
                try:
                    self.get(ref, deadline, what.format(rank=rank) + late)
                except GroupStartError as exc:
                    if exc.mismatch is not None:
                        _collect([*done, *pending], deadline)
                    raise

    def timed_out(self, what: str) -> GroupStartError:
        return GroupStartError(f"timed out trying to {what} within fault_tolerance.start_timeout_s="
                               f"{self.start_timeout_s:g}s")

    def get(self, ref: ray.ObjectRef, deadline: float, what: str):
        try:
            return ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except GetTimeoutError:
            raise self.timed_out(what) from None
        except (WorkerFailure, RayActorError) as exc:
            # Ray wraps the worker's exception; its cause is the WorkerFailure itself
            cause = getattr(exc, "cause", None) or exc
            raise GroupStartError(f"failed to {what}: {exc}", getattr(cause, "mismatch", None)) from None
        except RayTaskError as exc:  # anything else a rank raised while starting: a failed start, counted
            cause = getattr(exc, "cause", None) or exc
            raise GroupStartError(f"failed to {what}: {type(cause).__name__}: {headline(str(cause))}") from None


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _collect(refs: list[ray.ObjectRef], deadline: float, wait_s: float = 5.0) -> None:
    """Fetch and drop what the other ranks' calls return: after a checkpoint mismatch every rank
    fails the same way, and Ray prints each failure nobody fetched as an unhandled error, with
    its traceback, beside the one-line message the user gets."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(wait_s, deadline - time.monotonic())))
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # the same mismatch, reported once already
            pass
