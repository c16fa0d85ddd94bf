"""TensorBoard output of a real job with a restart, read back with TensorBoard's own reader.

Rank 1 hangs after step 12 (step 10 is committed), so rank 0 has logged steps 11 and 12 and
flushed them before the hang is detected; the restart resumes from step 10 and trains 11-14
again. ``EventAccumulator`` must see one point per step, strictly in order, with the values
of the run that finished (its losses equal the job's result), and the driver's run must hold
the commits, the failure and the restart.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import raytrain_ckpt
from raytrain_ckpt.common.faults import ENV_VAR

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"


def _events(path: Path) -> list:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return list(EventFileLoader(str(path)).Load())


def test_scalars_across_a_restart_have_one_point_per_step(ray_cluster, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed: "
                                              "pip install 'raytrain-ckpt[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv(ENV_VAR, "hang@step:rank=1,step=12")
    tb = tmp_path / "tb"
    result = raytrain_ckpt.run(DEMO, ["training.steps=14", "training.log_every_steps=1", "checkpoint.interval_steps=5",
                                      "resources.cpus_per_worker=1", "fault_tolerance.max_restarts=1",
                                      "fault_tolerance.hang_timeout_s=8", f"checkpoint.dir={tmp_path / 'ckpt'}",
                                      f"training.tensorboard_dir={tb}"])
    assert result.state is raytrain_ckpt.JobState.SUCCEEDED, result.error
    assert result.attempts == 2 and [f.kind for f in result.failures] == ["hang"]
    train = tb / "llama-debug-fsdp" / "train"
    files = sorted(train.glob("events.out.tfevents.*"))
    assert len(files) == 2, files  # one per attempt
    first = {e.step for e in _events(files[0]) if e.summary.value and e.summary.value[0].tag == "train/loss"}
    assert {11, 12} <= first  # the hung attempt's points after the resume step were written...
    marker = [e for e in _events(files[1]) if e.HasField("session_log")]
    assert marker and marker[0].session_log.status == marker[0].session_log.START and marker[0].step == 11

    acc = EventAccumulator(str(train)).Reload()  # ...and TensorBoard's reader replaces them
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 15))
    by_step = {e.step: e.value for e in loss}
    assert {11, 12, 13, 14} <= set(result.losses)  # the replayed steps' values are the finishing attempt's
    steps = sorted(result.losses)
    assert [by_step[s] for s in steps] == pytest.approx([result.losses[s] for s in steps], rel=1e-6)
    for tag in ("train/lr", "train/tokens_per_s", "train/step_time_s"):
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, 15)), tag

    driver = EventAccumulator(str(tb / "llama-debug-fsdp" / "driver")).Reload()
    commits = [e.step for e in driver.Scalars("checkpoint/committed_step")]
    assert commits == sorted(set(commits)) and {10, 14} <= set(commits), commits
    assert [e.step for e in driver.Scalars("checkpoint/persist_s")] == commits
    hangs = driver.Scalars("job/failures/hang")
    assert [e.value for e in hangs] == [1.0] and hangs[0].step >= 10
    assert [e.value for e in driver.Scalars("job/restarts")] == [1.0]
