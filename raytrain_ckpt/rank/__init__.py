"""One training rank: the ``TrainWorker`` actor and its parts (rendezvous, checkpoints, answers), the
Ray-free ``Trainer``, the loss guard and its rollback, eviction, progress files, the NCCL flight
recorder. Runs in each rank's process.
"""
