"""Job spec: the one file a user writes, validated at the edge.

Precedence, stated once: CLI ``--set path=value`` > spec file > field defaults.
Every problem is reported as ``path[=value]: what is wrong; how to fix it``.

``sections.py`` holds one pydantic model per section, ``job.py`` the whole ``JobSpec`` and the
checks across sections, ``loading.py`` file reading, overrides and error formatting. Checks of a
spec against the machine (paths, memory, an object store) and ``load_spec`` are in
``raytrain_ckpt/control/preflight.py``: this package imports nothing of the checkpoint machinery.
"""

from raytrain_ckpt.spec.job import JobSpec
from raytrain_ckpt.spec.loading import apply_overrides, format_validation_error, parse_overrides, parse_spec, read_spec
from raytrain_ckpt.spec.sections import (
    CheckpointSpec,
    DataSpec,
    FaultToleranceSpec,
    FieldProblems,
    FinalExportSpec,
    LRSchedulerSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelismSpec,
    ResourcesSpec,
    SpecError,
    TrainingSpec,
)

__all__ = [
    "CheckpointSpec",
    "DataSpec",
    "FaultToleranceSpec",
    "FieldProblems",
    "FinalExportSpec",
    "JobSpec",
    "LRSchedulerSpec",
    "ModelSpec",
    "OptimizerSpec",
    "ParallelismSpec",
    "ResourcesSpec",
    "SpecError",
    "TrainingSpec",
    "apply_overrides",
    "format_validation_error",
    "parse_overrides",
    "parse_spec",
    "read_spec",
]
