"""Job spec: the one file a user writes, validated at the edge.

Precedence, stated once: CLI ``--set path=value`` > spec file > field defaults.
Every problem is reported as ``path[=value]: what is wrong; how to fix it``.

``sections.py`` holds one pydantic model per section, ``job.py`` the whole ``JobSpec`` and the
checks across sections, ``loading.py`` file reading, overrides and error formatting.
"""

from raytrain_ckpt.spec.job import JobSpec
from raytrain_ckpt.spec.loading import (apply_overrides, check_environment, format_validation_error, load_spec,
                                        parse_overrides, validate_spec)
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
    "check_environment",
    "format_validation_error",
    "load_spec",
    "parse_overrides",
    "validate_spec",
]
