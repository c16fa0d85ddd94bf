"""``.group.json``: the layout of the group last configured, under the job's root, so that an
actor Ray restarts (with its constructor arguments only) knows the world size of the saves in
flight. Not a step: nothing scans it.

Sealed with the run's key, as the failed saves and the checks are (``seals.py``): the file is
the JSON, then a line with its HMAC-SHA256. A restarted actor does not take a layout its run never
configured: with a planted ``world_size`` of 1, one rank's report would commit a save of two.
Read like the actor's other root files: no link followed, no FIFO blocked on, bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
from dataclasses import asdict

from raytrain_ckpt.checkpoint.records import GroupLayout
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.storage.posix import read_small_file

logger = logging.getLogger(__name__)

__all__ = ["GROUP_FILE", "GROUP_MAX_BYTES", "GroupFile"]

GROUP_FILE = ".group.json"
"""The layout of the group last configured, under the job's root."""
GROUP_MAX_BYTES = 1 << 20
"""The most of ``GROUP_FILE`` a starting actor reads (the layout and the model section: a few KB)."""
_DOMAIN = b"raytrain_ckpt group layout v1\0"


class GroupFile:
    """Writes and reads back the group's layout; ``key``: the run's seal key (None: unsealed)."""

    def __init__(self, layout: CheckpointLayout, key: bytes | None) -> None:
        self.layout, self._key = layout, key
        self.path = layout.storage.join(layout.root, GROUP_FILE)

    def _mac(self, body: bytes) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, _DOMAIN + body, hashlib.sha256).hexdigest().encode("ascii")

    async def write(self, group: GroupLayout) -> None:
        """Record ``group``. A full disk or a root moved away is logged, and the old file removed:
        the group still starts, and an actor Ray restarts must not read the previous layout."""
        data = json.dumps(asdict(group)).encode()
        if self._key is not None:
            data += b"\n" + self._mac(data) + b"\n"
        try:
            await asyncio.to_thread(self.layout.protocol.replace_small_file, self.path, data)
        except Exception as exc:  # noqa: BLE001 - the layout is in memory for this actor's life
            logger.warning("could not record the group's layout in %s (%s); training goes on, saves fail "
                           "until the storage takes writes again", self.path, exc)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.layout.storage.remove_file, self.path)

    def read(self) -> GroupLayout:
        """The layout recorded, or the empty one when there is none this run's actors wrote."""
        storage = self.layout.storage
        if not storage.is_file(self.path):
            return GroupLayout()
        try:
            data = read_small_file(storage, self.path, GROUP_MAX_BYTES)
            if self._key is not None:  # a layout this run's actors did not write is not taken
                data, _, mac = data.rstrip(b"\n").rpartition(b"\n")
                if not hmac.compare_digest(mac, self._mac(data)):
                    raise ValueError("not written by an actor of this run (its seal does not hold)")
            g = json.loads(data.decode("utf-8"))
            return GroupLayout(int(g["world_size"]), int(g["dp_size"]), str(g["spec_hash"]), g.get("model"))
        except (ValueError, KeyError, TypeError, OSError, OverflowError, RecursionError) as exc:
            # unreadable (int(Infinity), nesting past the decoder's depth too): the next configure() rewrites it
            logger.warning("ignoring %s: %s", self.path, exc)
            return GroupLayout()
