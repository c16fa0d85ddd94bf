"""The health probe's GPU check on a real CUDA device: in-process, and as the Ray task a GPU job
runs in a free bundle of its placement group. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from raytrain_ckpt.control.watch.health import gpu_problem, plan_probes, probe_nodes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_gpu_check_passes_on_a_healthy_device_and_names_a_timeout():
    assert gpu_problem() is None
    # a check that cannot finish in time is reported as such (a big matmul, no time at all)
    late = gpu_problem(timeout_s=0.0, n=8192)
    assert late == "a 8192x8192 matmul and synchronize on its GPU(s) did not finish within 0s"


def test_the_probe_task_gets_the_bundles_gpu_and_passes(ray_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raytrain_ckpt.control.pool import bundle_nodes

    ray = ray_cluster
    pg = placement_group([{"CPU": 1, "GPU": 1}])
    try:
        assert pg.wait(timeout_seconds=60)
        nodes = bundle_nodes(pg)
        plans = plan_probes(nodes, nodes, set(), 1.0)
        assert plans[0].checks_gpu
        assert probe_nodes(plans, None, pg) == {}
        # the bundle's GPU is free again for the rank: a task asking it in the bundle runs
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)

        def device_count() -> int:  # defined here, so Ray ships it by value (no test module on workers)
            import torch

            return torch.cuda.device_count()

        holder = ray.remote(num_gpus=1, num_cpus=0)(device_count)
        assert ray.get(holder.options(scheduling_strategy=strategy).remote(), timeout=60) == 1
    finally:
        remove_placement_group(pg)

