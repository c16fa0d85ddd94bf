"""The quarantine's bookkeeping: two crashes or hangs of a node's ranks within the window put it
out for quarantine_s; the placement group's label selector keeps every bundle off it."""

from __future__ import annotations

from raytrain_ckpt.control.watch.quarantine import NODE_ID_LABEL, Quarantine
from raytrain_ckpt.spec import JobSpec


def test_two_failures_within_the_window_put_a_node_out_for_a_while():
    q = Quarantine(quarantine_s=100.0, window_s=50.0)
    assert not q.note("a", 0.0) and q.excluded(1.0) == []
    assert not q.note("a", 60.0)                          # the first one is out of the window
    assert q.note("a", 70.0) and q.excluded(71.0) == ["a"]
    assert not q.note("a", 80.0)                          # already out: said once
    assert q.selector(100.0, 2) == [{NODE_ID_LABEL: "!in(a)"}] * 2
    assert q.excluded(170.0) == [] and q.selector(170.0, 2) is None   # back after quarantine_s


def test_quarantine_off_and_the_default():
    off = Quarantine(quarantine_s=None, window_s=None)
    assert not off.note("a", 0.0) and not off.note("a", 1.0) and off.excluded(2.0) == []
    ft = JobSpec(name="q").fault_tolerance
    assert ft.quarantine_s == 1800.0
    whole = Quarantine(ft.quarantine_s, None)               # no window: every failure of the job counts
    whole.note("b", 0.0)
    assert whole.note("b", 1e6) and whole.selector(1e6, 1) == [{NODE_ID_LABEL: "!in(b)"}]


def test_the_health_probe_names_a_full_staging_file_system_and_an_unwritable_root(tmp_path):
    import os

    from raytrain_ckpt.control.watch.health import node_problem

    root = tmp_path / "root"
    root.mkdir()
    assert node_problem(tmp_path, str(root), min_free=1) is None and list(root.iterdir()) == []
    full = node_problem(tmp_path, None, min_free=2**62)
    assert full is not None and full.startswith(f"the staging file system {tmp_path} has ") and "MiB free" in full
    assert node_problem(tmp_path / "missing", None).startswith(f"the staging file system {tmp_path / 'missing'}")
    if os.geteuid() != 0:  # root writes through a read-only mode
        root.chmod(0o500)
        assert "cannot be written" in node_problem(tmp_path, str(root), min_free=1)
    ro = tmp_path / "file-not-dir"
    ro.write_text("x")
    assert node_problem(tmp_path, str(ro), min_free=1).startswith(f"the checkpoint root {ro} cannot be written")


def test_a_kept_process_runs_its_nodes_probe_and_one_that_died_leaves_the_node_to_a_new_process(ray_cluster, tmp_path):
    """On a CPU node that still holds a kept rank, the health probe's checks run in that process (no
    new Ray worker on the restart's path), and its answer is the node's; a kept process that died
    after its reset is no verdict on its node: the probe's task checks it instead."""
    import ray

    from raytrain_ckpt.control.watch.health import ProbePlan, probe_nodes

    @ray.remote(num_cpus=0)
    class Kept:
        def __init__(self, problem: str | None) -> None:
            self.problem = problem

        def node_problem(self, root: str | None) -> str | None:
            return self.problem

    node = ray.get_runtime_context().get_node_id()
    plans = [ProbePlan(node, None, 0.0)]
    sick, dead = Kept.remote("the staging file system /dev/shm has 1 MiB free, under 64 MiB"), Kept.remote(None)
    ray.get(dead.__ray_ready__.remote())
    ray.kill(dead, no_restart=True)
    unwritable = tmp_path / "file-not-dir"
    unwritable.write_text("x")
    try:
        assert probe_nodes(plans, None, kept={node: sick}) == {node: ray.get(sick.node_problem.remote(None))}
        # the task ran the checks (the dead process could not): the root it cannot write is named
        problem = probe_nodes(plans, str(unwritable), kept={node: dead})[node]
        assert problem.startswith(f"the checkpoint root {unwritable} cannot be written"), problem
        assert probe_nodes(plans, str(tmp_path), kept={node: dead}) == {}
    finally:
        ray.kill(sick, no_restart=True)
