"""Fault settings reach actors as an argument from the driver, and only from it."""

from __future__ import annotations

import os


def test_an_actor_takes_the_drivers_fault_settings_and_drops_any_it_inherited(monkeypatch):
    """A cluster whose processes were started with a fault setting (a ``ray start`` from a shell
    that had one) must not inject it into a run whose driver asked for none."""
    from raytrain_ckpt.faults import ENV_VAR, STAMP_VAR, adopt_fault_env, fault_env

    monkeypatch.setenv(ENV_VAR, "exit@step:rank=0,step=1")
    monkeypatch.setenv(STAMP_VAR, "/tmp/inherited-stamp")
    adopt_fault_env(None)
    assert ENV_VAR not in os.environ and STAMP_VAR not in os.environ and fault_env() == {}
    adopt_fault_env({ENV_VAR: "hang@step:rank=1,step=3"})
    assert fault_env() == {ENV_VAR: "hang@step:rank=1,step=3"}
