"""The shared-storage preflight: does every node see the same ``checkpoint.dir``?

A step commits only when the CheckpointActor's node sees every rank's shard files. With a
local path that is a node-local disk on several nodes, each writer writes to its own disk and
every save would be aborted: the job would train without checkpoints. So before the first
attempt starts, each node's CheckpointWriter writes a probe file ``<root>/.probe-<node>-<nonce>``
through its local filesystem, the CheckpointActor lists the probes it sees, and
``missing_probes`` decides. Each writer removes its own probe afterwards (on a private disk
nobody else can).

An object-store URI (``s3://``, ``gs://``) is one namespace for every node by nature: there is
nothing to probe.
"""

from __future__ import annotations

from raytrain_ckpt.checkpoint.records import NodeProbe

__all__ = ["PROBE_PREFIX", "local_root", "missing_probes", "probe_name",
           "unshared_message"]

PROBE_PREFIX = ".probe-"
"""Probe files start with this; they are dot files, so no step scan ever looks at them."""


def probe_name(node_id: str, nonce: str) -> str:
    """The probe file of ``node_id`` for one preflight (``nonce``: unique per job start)."""
    return f"{PROBE_PREFIX}{node_id}-{nonce}"


def local_root(root: str) -> str | None:
    """The local path to probe for a checkpoint root; None for an object-store URI (shared by nature).

    ``file://`` URIs are local paths too: node-local disks are possible there as well.
    """
    if root.startswith("file://"):
        return root.removeprefix("file://")
    return None if "://" in root else root


def missing_probes(expected: list[NodeProbe], seen: set[str]) -> list[NodeProbe]:
    """The nodes whose probe the CheckpointActor does not see (empty: the directory is shared)."""
    return [p for p in expected if p.name not in seen]


def unshared_message(root: str, missing: list[NodeProbe], actor_node: str) -> str:
    """One line: which nodes, why it matters, how to fix it."""
    nodes = ", ".join(f"{p.node_id[:12]} ({p.address})" for p in missing)
    return (f"checkpoint.dir={root}: not shared by every node: the checkpoint actor on node {actor_node[:12]} "
            f"cannot see the probe files written there by node(s) {nodes}, so no checkpoint could ever commit; "
            "mount one shared filesystem (NFS, EFS, Lustre) at that path on every node, or set checkpoint.dir "
            "to an object store URI such as s3://bucket/prefix")
