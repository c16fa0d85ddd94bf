"""Checkpoints: DCP directories written through per-node writers and one CheckpointActor.

Rooms, each a sub-package, from the bottom up (``tests/unit/test_imports.py`` checks who may
import whom; only ``roles`` talks to Ray):

- ``format``: what a valid step is: names, the manifest, checksums, safe ``.metadata`` reading.
- ``storage``: where bytes live and how a step becomes durable (POSIX rename or manifest-last).
- ``policy``: pure decisions: retention, the save interval and schedule, step selection.
- ``datapath``: the bytes' road: staging buffers, shard sinks (local file, multipart upload).
- ``recovery``: loading a committed step from RAM, a peer replica or storage.
- ``interchange``: export and import.
- ``roles``: the processes: trainer client, node writer, coordinator, driver service.

Beside them, ``records`` (what crosses a process) and ``errors`` (what a user or another
process can see).
"""
