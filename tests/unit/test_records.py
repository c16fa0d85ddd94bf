"""What crosses a process is a record: the annotated signatures of the remote methods.

Checked: every public method of ``CheckpointActor``, ``CheckpointWriter`` and ``TrainWorker``
(the classes that become Ray actors), each parameter and the return annotation, resolved with
``typing.get_type_hints``. The rule, for each annotation:

- allowed leaves: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``; an ``Enum``; a
  ``Literal`` of those; a record, i.e. a frozen dataclass defined in
  ``raytrain_ckpt.checkpoint.records`` or listed in ``FOREIGN_RECORDS`` (frozen dataclasses that
  live beside their producer); the DCP types in ``DCP_TYPES`` (torch's own plan and result types);
  a Ray ``ActorHandle`` or ``ObjectRef`` (a reference, not data);
- allowed compositions: a union of allowed types (``X | None``); a collection of leaves:
  ``list[X]``, ``tuple[X, ...]`` (variable length), ``set[X]``, ``dict[K, X]`` with ``K`` ``str``
  or ``int``; a collection of collections is not allowed (a dict of dicts is a record in disguise);
- refused: a missing annotation, ``Any``, ``object``, a bare ``dict``/``list``/``tuple``, a fixed
  tuple ``tuple[A, B]`` (a positional record), ``dict[str, Any]``, any other class.

``PENDING`` lists the methods allowed to fail for now (none).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
import typing

import pytest
from ray import ObjectRef
from ray.actor import ActorHandle
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from raytrain_ckpt.checkpoint import records
from raytrain_ckpt.checkpoint.policy.interval import IntervalDecision
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.roles.writer import CheckpointWriter
from raytrain_ckpt.common.events import NodeProgress, Progress, RankPlace, WorkerResult
from raytrain_ckpt.rank.rendezvous import Rendezvous
from raytrain_ckpt.rank.worker import TrainWorker

PRIMITIVES = (type(None), bool, int, float, str, bytes)
DCP_TYPES = (SavePlan, WriteResult, Metadata)
FOREIGN_RECORDS = (
    IntervalDecision,  # the interval policy's decision, reported to the CheckpointActor as it is
    NodeProgress, Progress, RankPlace, WorkerResult,  # a TrainWorker's answers to the driver (common/events.py)
    Rendezvous,  # rank 0's store address (rank/rendezvous.py)
)
HANDLES = (ActorHandle, ObjectRef)
"""Ray references: they cross as themselves (a handle is how one actor names another)."""
PENDING: set[str] = set()
REMOTE_CLASSES = (CheckpointActor, CheckpointWriter, TrainWorker)


def _is_record(tp: object) -> bool:
    if not (isinstance(tp, type) and dataclasses.is_dataclass(tp) and tp.__dataclass_params__.frozen):
        return False
    return tp.__module__ == records.__name__ or tp in FOREIGN_RECORDS


def _is_leaf(tp: object) -> bool:
    if tp in PRIMITIVES or tp in DCP_TYPES or tp in HANDLES or _is_record(tp):
        return True
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return True
    if typing.get_origin(tp) is typing.Literal:
        return all(isinstance(v, (bool, int, float, str, bytes, type(None))) for v in typing.get_args(tp))
    return False


def problem(tp: object) -> str | None:
    """Why ``tp`` may not cross a process (None: it may); see the module docstring."""
    if _is_leaf(tp):
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return next((p for p in map(problem, args) if p is not None), None)
    if origin in (list, set, frozenset) and len(args) == 1:
        return None if _is_leaf(args[0]) else f"{tp}: a collection of {args[0]}, not of records or primitives"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return None if _is_leaf(args[0]) else f"{tp}: a collection of {args[0]}, not of records or primitives"
    if origin is dict and len(args) == 2:
        if args[0] not in (str, int):
            return f"{tp}: keyed by {args[0]}, not str or int"
        return None if _is_leaf(args[1]) else f"{tp}: values {args[1]} are not records or primitives"
    if origin is tuple:
        return f"{tp}: a positional tuple; make it a record in checkpoint/records.py"
    return f"{tp}: not a primitive, a record or a collection of them"


def _remote_methods() -> list[tuple[str, typing.Callable]]:
    out = []
    for cls in REMOTE_CLASSES:
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_"):
                out.append((f"{cls.__name__}.{name}", fn))
    return out


def _signature_problems(fn: typing.Callable) -> list[str]:
    # Once a class has been made a Ray actor in this process, Ray's tracing wraps its methods with
    # an extra ``_ray_trace_ctx`` keyword: Ray's own plumbing, not part of what the method takes.
    fn = inspect.unwrap(fn)
    hints = {k: v for k, v in typing.get_type_hints(fn).items() if not k.startswith("_ray_")}
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.name != "self" and not p.name.startswith("_ray_")]
    found = [f"{p.name}: no annotation" for p in params if p.name not in hints]
    if "return" not in hints:
        found.append("return: no annotation")
    for name, tp in hints.items():
        why = problem(tp)
        if why is not None:
            found.append(f"{name}: {why}")
    return found


@pytest.mark.parametrize(("name", "fn"), _remote_methods(), ids=[n for n, _ in _remote_methods()])
def test_remote_methods_take_and_return_records(name, fn):
    found = _signature_problems(fn)
    if name in PENDING:
        pytest.xfail(f"{name} is converted by another branch: {found}")
    assert found == [], f"{name}: {found}"


def test_pending_lists_only_methods_that_still_fail():
    """An entry of ``PENDING`` that passes must leave it (the list only shrinks)."""
    methods = dict(_remote_methods())
    assert set(PENDING) <= set(methods), sorted(set(PENDING) - set(methods))
    assert [n for n in sorted(PENDING) if not _signature_problems(methods[n])] == []


@pytest.mark.parametrize(("tp", "ok"), [
    (int, True), (str | None, True), (records.RankReport, True), (list[records.FileSum], True),
    (dict[str, records.FileSum], True), (dict[int, str], True), (tuple[int, ...], True), (SavePlan, True),
    (typing.Literal["size", "checksum"], True), (records.StepPhase, True),
    (dict, False), (tuple[str, int], False), (typing.Any, False), (dict[str, typing.Any], False),
    (dict[str, dict[str, int]], False), (list[dict[str, int]], False), (object, False),
])
def test_the_rule(tp, ok):
    assert (problem(tp) is None) is ok, problem(tp)


def test_records_are_frozen_dataclasses():
    for name in records.__all__:
        obj = getattr(records, name)
        if isinstance(obj, type) and not issubclass(obj, enum.Enum):
            assert dataclasses.is_dataclass(obj) and obj.__dataclass_params__.frozen, name
    for cls in FOREIGN_RECORDS:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
