"""What the health probe checks for a GPU job (where it runs, which GPUs it asks), and the GPU
check's answer on a machine without a visible CUDA device."""

from __future__ import annotations

import pytest
import torch

from raytrain_ckpt.control.watch.health import ProbePlan, gpu_problem, plan_probes

# bundle index -> node of a 4-bundle group: two bundles on each of nodes a and b
BUNDLES = ["a", "a", "b", "b"]


@pytest.mark.parametrize("nodes, busy, gpus, expected", [
    # a CPU job: pinned to the node, no GPU asked
    (["a"], set(), 0.0, [ProbePlan("a", None, 0.0)]),
    # a GPU job after a new placement: the node's first bundle, with one rank's GPUs
    (["a", "b"], set(), 1.0, [ProbePlan("a", 0, 1.0), ProbePlan("b", 2, 1.0)]),
    # a kept group: the bundle a kept rank holds is skipped, the failed rank's is used
    (["a"], {0}, 1.0, [ProbePlan("a", 1, 1.0)]),
    (["b"], {2}, 0.5, [ProbePlan("b", 3, 0.5)]),
    # every bundle on the node holds a kept rank: no GPU check (it would wait for them)
    (["a"], {0, 1}, 1.0, [ProbePlan("a", None, 1.0)]),
    # a node named twice is probed once
    (["b", "b"], set(), 2.0, [ProbePlan("b", 2, 2.0)]),
])
def test_the_probe_of_a_gpu_job_runs_in_a_free_bundle_of_the_node(nodes, busy, gpus, expected):
    plans = plan_probes(nodes, BUNDLES, busy, gpus)
    assert plans == expected
    assert [p.checks_gpu for p in plans] == [p.bundle is not None and gpus > 0 for p in expected]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a CUDA device")
def test_the_gpu_check_without_a_visible_device_names_the_devices_it_was_given(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_problem() == "no CUDA device is visible (CUDA_VISIBLE_DEVICES='')"
