"""The leak check of tests/conftest.py (``nothing_left_behind``): what was there before a test is
not a leak, what goes within the grace period is not a leak, what stays is named."""

from __future__ import annotations

import time

from tests.conftest import leftovers


def test_what_was_there_before_is_not_a_leak():
    assert leftovers({"a": "actor A"}, [lambda: {"a": "actor A"}], grace_s=0) == {}


def test_what_stays_is_named():
    probes = [lambda: {"a": "actor A"}, lambda: {"pg": "placement group P CREATED"}, lambda: {}]
    assert leftovers({}, probes, grace_s=0.3) == {"a": "actor A", "pg": "placement group P CREATED"}


def test_what_goes_within_the_grace_period_is_not_a_leak():
    gone_at = time.monotonic() + 0.5

    def draining() -> dict[str, str]:
        return {"/dev/shm/x/rtc-j-a0-rank0.buf": "staging file"} if time.monotonic() < gone_at else {}

    assert leftovers({}, [draining], grace_s=5) == {}
    assert time.monotonic() - gone_at < 2
