"""The driver: the controller's state machine, the Ray worker group and pool, preflight checks, the
reaper and the hang evidence. Runs in the driver process; its detectors are in ``watch/``.
"""
