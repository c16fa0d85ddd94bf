"""The processes of the checkpoint machinery and the only room that talks to Ray: the trainer's
``CheckpointClient``, the per-node ``CheckpointWriter``, the job's ``CheckpointActor`` (coordinator,
step registry, resume timeline, retainer, status board) and the driver's ``CheckpointService``. What
they hand each other is a record from ``checkpoint/records.py``."""
