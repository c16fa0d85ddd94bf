"""raytrain_ckpt: Ray-orchestrated, fault-tolerant PyTorch training jobs."""

from raytrain_ckpt.spec import JobSpec, SpecError, load_spec

__all__ = ["JobSpec", "SpecError", "load_spec", "__version__"]

__version__ = "0.1.0"
