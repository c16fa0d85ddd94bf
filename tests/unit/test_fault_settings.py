"""Fault settings reach actors as an argument from the driver, and only from it."""

from __future__ import annotations

import os


def test_an_actor_takes_the_drivers_fault_settings_and_drops_any_it_inherited(monkeypatch):
    """A cluster whose processes were started with a fault setting (a ``ray start`` from a shell
    that had one) must not inject it into a run whose driver asked for none."""
    from raytrain_ckpt.common.faults import ENV_VAR, STAMP_VAR, adopt_fault_env, fault_env

    monkeypatch.setenv(ENV_VAR, "exit@step:rank=0,step=1")
    monkeypatch.setenv(STAMP_VAR, "/tmp/inherited-stamp")
    adopt_fault_env(None)
    assert ENV_VAR not in os.environ and STAMP_VAR not in os.environ and fault_env() == {}
    adopt_fault_env({ENV_VAR: "hang@step:rank=1,step=3"})
    assert fault_env() == {ENV_VAR: "hang@step:rank=1,step=3"}


def test_an_unknown_fault_is_refused_before_ray_starts(monkeypatch, capsys):
    """A misspelt fault kind would otherwise fail every rank at its first fault point, restart
    after restart: ``run`` refuses it with one line and exit 2, before Ray is started."""
    from raytrain_ckpt.cli import main as cli
    from raytrain_ckpt.common.faults import ENV_VAR

    def never(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(cli, "_run", never)
    monkeypatch.setenv(ENV_VAR, "explode@step:rank=0,step=1")
    assert cli.main(["run", "jobs/llama_debug_fsdp.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {ENV_VAR}: bad fault 'explode@step:rank=0,step=1'")
    monkeypatch.setenv(ENV_VAR, "exit@step:rank=0")
    assert cli.main(["run", "jobs/llama_debug_fsdp.yaml"]) == 2
    assert "cannot parse" in capsys.readouterr().err


def test_a_valid_fault_plan_passes_the_check():
    from raytrain_ckpt.common.faults import ENV_VAR, fault_plan_problem

    assert fault_plan_problem({}) is None
    assert fault_plan_problem({ENV_VAR: "slow@persist:rank=0,step=2;exit@persist:rank=0,step=2"}) is None
