"""Records that cross a process boundary in the checkpoint machinery: frozen dataclasses only.

Everything one process hands another (a trainer to its node's writer, a writer to the
CheckpointActor, the driver to the trainers, the actor to the driver and the CLI) is one of
these types, never a dict or a positional tuple, so both sides name the same fields and a
remote method's signature says what it takes. Plain data: they import neither torch nor Ray.
"""

from __future__ import annotations

__all__: list[str] = []
