"""What the Ray dashboard's actor list shows: Ray computes an actor's repr once, when it starts,
so a repr must hold only what stays true for the actor's life."""

from __future__ import annotations

from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy


def test_checkpoint_actor_and_writer_reprs_are_short_and_name_their_job(tmp_path):
    """The repr is the dashboard's actor description and the prefix of each of the actor's log
    lines: the kind and the job, nothing that changes (Ray computes it once)."""
    from raytrain_ckpt.checkpoint.roles.writer import CheckpointWriter

    root = tmp_path / "ckpt" / "my-job"
    actor = CheckpointActor(str(root), RetentionPolicy(None))
    assert repr(actor) == "CheckpointActor(my-job)"
    writer = object.__new__(CheckpointWriter)  # (its __init__ maps /dev/shm buffers and renices the process)
    assert repr(writer) == "CheckpointWriter(not started)"  # an __init__ that raised: the repr must not raise
    from raytrain_ckpt.checkpoint.roles.metrics import WriterMetrics

    writer.metrics = WriterMetrics("my-job", "a13e1a458185")
    assert repr(writer) == "CheckpointWriter(my-job)"
    assert repr(object.__new__(CheckpointActor)) == "CheckpointActor(not started)"


def test_train_worker_repr_names_job_and_rank_or_spare():
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.worker import TrainWorker

    # Built without __init__: constructing a worker configures the process (logging, torch
    # threads) for a Ray actor, which a test process must not take on.
    worker = object.__new__(TrainWorker)
    worker.spec, worker.rank, worker.world_size, worker.was_spare = JobSpec(name="my-job"), 1, 2, False
    assert repr(worker) == "TrainWorker(my-job rank 1/2)"
    worker.attempt = 3  # a kept process serves a later attempt: nothing in the repr goes stale
    assert repr(worker) == "TrainWorker(my-job rank 1/2)"
    worker.rank = -1  # SPARE_RANK: an idle spare
    assert repr(worker) == "TrainWorker(my-job spare)"


def test_a_spare_that_takes_a_rank_renames_its_ray_log_prefix(monkeypatch, capsys):
    """Ray prefixes an actor's log lines with the repr it started with; a later ``:actor_name:``
    line on stdout and stderr renames it (Ray's log monitor), outside an actor nothing is written."""
    import types

    import ray

    from raytrain_ckpt.common.logs import rename_log_prefix

    rename_log_prefix("TrainWorker(my-job rank 1/2)")
    assert capsys.readouterr() == ("", "")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_actor_id=lambda: "a1"))
    rename_log_prefix("TrainWorker(my-job rank 1/2)")
    out = capsys.readouterr()
    assert out.out == out.err == ":actor_name:TrainWorker(my-job rank 1/2)\n"


def test_train_worker_repr_of_a_worker_whose_spec_did_not_load():
    """Ray evaluates the repr also for an actor whose __init__ raised (a spec a rank cannot load:
    a factory its node cannot import): the repr must not raise, or the driver is told of an
    AttributeError of the repr instead of the real error."""
    from raytrain_ckpt.rank.worker import TrainWorker

    worker = object.__new__(TrainWorker)
    worker.was_spare = False  # what __init__ sets before it loads the spec
    assert repr(worker) == "TrainWorker(not started)"
