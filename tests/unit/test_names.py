"""A named actor passed as plain data (no Ray needed to build, copy or pickle one)."""

from __future__ import annotations

import copy
import pickle

import pytest

from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, ActorByName, actor_name


def test_actor_by_name_pickles_as_its_name_without_looking_it_up():
    ref = ActorByName(actor_name("job-a"))
    back = pickle.loads(pickle.dumps(ref))
    assert (back.name, back.namespace) == ("rtc-ckpt-job-a", NAMESPACE)
    assert copy.copy(ref).name == ref.name
    with pytest.raises(AttributeError):
        ref._private  # noqa: B018 - dunder and private probes must not trigger a lookup
    assert ref._handle is None
