"""Where a checkpoint's bytes live and how a step becomes durable: the ``Storage`` protocol (a POSIX
directory, an object store through fsspec), the ``CommitProtocol`` chosen once from the root (rename, or
the manifest written last), the root's layout, leases, the run lock and the shared-storage probe.
Imports only ``format``."""
