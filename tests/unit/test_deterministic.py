"""``training.deterministic``: the switch a GPU worker makes before it builds the model."""

from __future__ import annotations

import os
import subprocess
import sys

from raytrain_ckpt.control.preflight import load_spec


def test_deterministic_cuda_switches_torch_to_deterministic_kernels():
    # a fresh process: the switch is process-wide, and cuBLAS reads its setting once
    code = ("import os, torch; from raytrain_ckpt.rank.rendezvous import _deterministic_cuda; "
            "assert not torch.are_deterministic_algorithms_enabled(); _deterministic_cuda(); "
            "print(torch.are_deterministic_algorithms_enabled(), os.environ['CUBLAS_WORKSPACE_CONFIG'])")
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", ":4096:8"]


def test_deterministic_is_off_by_default_and_settable():
    assert load_spec("jobs/llama_debug_fsdp.yaml").training.deterministic is False
    assert load_spec("jobs/llama_debug_fsdp.yaml", ["training.deterministic=true"]).training.deterministic is True
