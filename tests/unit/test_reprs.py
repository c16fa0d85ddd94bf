"""What the Ray dashboard's actor list shows: Ray computes an actor's repr once, when it starts,
so a repr must hold only what stays true for the actor's life."""

from __future__ import annotations

from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy


def test_checkpoint_actor_repr_names_job_root_node_and_where_live_progress_is(tmp_path):
    root = tmp_path / "ckpt" / "my-job"
    actor = CheckpointActor(str(root), RetentionPolicy(None))
    text = repr(actor)
    import ray  # the full suite may have started its session Ray: the node is then named

    node = ray.get_runtime_context().get_node_id()[:12] if ray.is_initialized() else "-"
    assert text == (f"CheckpointActor(job=my-job root={root} node={node}; live: raytrain-ckpt status --job my-job)")
    assert "committed" not in text and "inflight" not in text  # progress would be frozen at start-up


def test_train_worker_repr_names_job_and_rank_or_spare():
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.worker import TrainWorker

    # Built without __init__: constructing a worker configures the process (logging, torch
    # threads) for a Ray actor, which a test process must not take on.
    worker = object.__new__(TrainWorker)
    worker.spec, worker.rank, worker.world_size, worker.was_spare = JobSpec(name="my-job"), 1, 2, False
    assert repr(worker) == "TrainWorker(my-job rank 1/2)"
    worker.attempt = 3  # a kept process serves a later attempt: nothing in the repr goes stale
    assert repr(worker) == "TrainWorker(my-job rank 1/2)"
    worker.was_spare = True
    assert repr(worker) == "TrainWorker(my-job spare)"


def test_train_worker_repr_of_a_worker_whose_spec_did_not_load():
    """Ray evaluates the repr also for an actor whose __init__ raised (a spec a rank cannot load:
    a factory its node cannot import): the repr must not raise, or the driver is told of an
    AttributeError of the repr instead of the real error."""
    from raytrain_ckpt.worker import TrainWorker

    worker = object.__new__(TrainWorker)
    worker.was_spare = False  # what __init__ sets before it loads the spec
    assert repr(worker) == "TrainWorker(not started)"
