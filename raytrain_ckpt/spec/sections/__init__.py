"""The sections of a job spec: one pydantic model each, a docstring under every field, one module
per group of sections.

Checks that involve one section only live with it (field and model validators); checks across
sections live with ``JobSpec`` in ``job.py``.
"""

from __future__ import annotations

from raytrain_ckpt.spec.sections.base import (
    FieldProblems,
    MAX_INT,
    MAX_RESOURCE_PER_WORKER,
    MAX_SECONDS,
    MAX_STEP,
    MIN_MB_PER_S,
    MIN_SECONDS,
    RESOURCE_UNIT,
    RESUME_VALUES,
    SpecError,
    is_ascii_digits,
)
from raytrain_ckpt.spec.sections.model import (
    DataSpec,
    EvalSpec,
    ModelSpec,
)
from raytrain_ckpt.spec.sections.training import (
    GuardSpec,
    LRSchedulerSpec,
    OptimizerSpec,
    ParallelismSpec,
    ResourcesSpec,
    TrainingSpec,
)
from raytrain_ckpt.spec.sections.checkpointing import (
    CheckpointSpec,
    DEFAULT_RESULTS,
    FinalExportSpec,
    KeepBestSpec,
    RESULTS_ENV,
    ReplicationSpec,
    results_dir,
)
from raytrain_ckpt.spec.sections.faults import (
    DEFAULT_JOIN_S,
    DEFAULT_MTBF_S,
    FaultToleranceSpec,
)

__all__ = [
    "CheckpointSpec",
    "DEFAULT_JOIN_S",
    "DEFAULT_MTBF_S",
    "DEFAULT_RESULTS",
    "DataSpec",
    "EvalSpec",
    "FaultToleranceSpec",
    "FieldProblems",
    "FinalExportSpec",
    "GuardSpec",
    "KeepBestSpec",
    "LRSchedulerSpec",
    "MAX_INT",
    "MAX_RESOURCE_PER_WORKER",
    "MAX_SECONDS",
    "MAX_STEP",
    "MIN_MB_PER_S",
    "MIN_SECONDS",
    "ModelSpec",
    "OptimizerSpec",
    "ParallelismSpec",
    "RESOURCE_UNIT",
    "RESULTS_ENV",
    "RESUME_VALUES",
    "ReplicationSpec",
    "ResourcesSpec",
    "SpecError",
    "TrainingSpec",
    "is_ascii_digits",
    "results_dir",
]
