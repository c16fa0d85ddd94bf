"""``training.loggers``: where a job's scalars go besides its own log (TensorBoard, W&B, MLflow,
or the user's own logger by import path). The backends themselves are ``raytrain_ckpt/observe/loggers.py``."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["BUILTIN_LOGGERS", "LoggersSpec"]

BUILTIN_LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""Each built-in backend -> the package it needs (its extra: pip install -e ".[wandb]")."""


class LoggersSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, strict=True)

    backends: list[str] = Field(default_factory=list)
    """Any of tensorboard (needs training.tensorboard_dir), wandb, mlflow, or a user logger 'package.module:factory' called as factory(job, run, run_id, resume_step) and returning an object with scalar(tag, value, step), config(dict) and close(). Each gets the resolved spec once as the run's config, rank 0's training scalars and the driver's checkpoint and failure events, in one run per job (its id derived from the job's checkpoint root) across restarts and resubmits; steps replayed after a restart are not logged twice. W&B and MLflow are written from a background thread with a bounded queue: a service that is down costs a warning and dropped points (the logger_dropped_total metric), never a stalled step. [] (default): none besides training.tensorboard_dir."""
    project: str = "raytrain-ckpt"
    """The W&B project and the MLflow experiment the job's run is in."""
    mlflow_tracking_uri: str | None = None
    """MLflow's tracking URI: a server (http://...) or a file store (file:/path/mlruns, which works offline); null: MLFLOW_TRACKING_URI, else MLflow's default (./mlruns)."""
    wandb_dir: str | None = None
    """The directory W&B writes its files to; null: W&B's default (./wandb)."""
    wandb_mode: Literal["online", "offline"] | None = None
    """W&B's mode in every process of the job (rank 0 runs on the cluster, where the driver's environment is not set): offline writes the run's files only (wandb sync uploads them); null: WANDB_MODE there, else online."""
    queue_size: int = Field(10000, ge=1)
    """Points a W&B, MLflow or user logger may hold unsent before new ones are dropped (and counted)."""

    @field_validator("backends")
    @classmethod
    def _known_and_installed(cls, value: list[str]) -> list[str]:
        for i, name in enumerate(value):
            problem = _problem(name)
            if problem:
                raise ValueError(f"[{i}]={name!r}: {problem}")
        if len(set(value)) != len(value):
            raise ValueError("a backend is named twice")
        return value


def _problem(name: str) -> str | None:
    package = BUILTIN_LOGGERS.get(name)
    if package is not None:
        if importlib.util.find_spec(package) is None:
            return f'the {package} package is not installed; pip install -e ".[{name}]" (or pip install {package})'
        return None
    if ":" not in name:
        return f"neither {', '.join(BUILTIN_LOGGERS)} nor a user logger 'package.module:factory'"
    from raytrain_ckpt.models import resolve_factory

    try:
        resolve_factory(name, "logger")
    except ValueError as exc:
        return str(exc)
    return None
