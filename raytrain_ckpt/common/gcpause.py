"""``collector_paused()``: the cyclic garbage collector off for a block that allocates millions of
objects none of which are in a cycle (a global save plan, a ``.metadata`` pickle at thousands of
ranks). Each full collection such a block triggers walks every live object of the process, so it
costs O(objects) per collection for nothing to collect."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """The block runs with the cyclic collector off; it is back on after it if it was on before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
