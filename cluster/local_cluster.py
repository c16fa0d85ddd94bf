"""A multi-node Ray cluster on one machine, for development.

    python cluster/local_cluster.py --workers 2 --cpus-per-node 2

Starts a head plus N worker nodes (separate raylets, so placement groups, node
affinity and "a node died" can be exercised without real machines), prints the
address to connect to, blocks until Ctrl-C or SIGTERM, then removes every node.

Each node carries custom resources so placement is visible in ``ray status`` and
can be targeted: the head has ``rtc_head: 1``, worker i has ``rtc_worker: 1`` and
``rtc_worker_<i>: 1``.

Connect from another process (token auth is on, so the client needs the mode too;
an explicit address never turns it on by itself):

    RAY_AUTH_MODE=token RAY_ADDRESS=<printed address> python -m raytrain_ckpt run jobs/llama_debug_fsdp.yaml
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker nodes besides the head (default 2)")
    p.add_argument("--cpus-per-node", type=float, default=2, help="logical CPUs of each worker node (default 2)")
    p.add_argument("--head-cpus", type=float, default=None,
                   help="logical CPUs of the head (default: --cpus-per-node; 0 keeps work off the head, "
                        "like a real cluster)")
    p.add_argument("--object-store-mb", type=int, default=200, help="object store per node in MiB (default 200)")
    p.add_argument("--dashboard-port", type=int, default=None,
                   help="start the dashboard on this port so `ray job submit` works (default: no dashboard)")
    p.add_argument("--temp-dir", default=None,
                   help="root of this cluster's session files (default: a fresh /tmp/rtc-XXXX, removed at exit)")
    p.add_argument("--no-auth", action="store_true", help="run without token authentication")
    p.add_argument("--address-file", default=None, help="also write the GCS address to this file once up")
    return p.parse_args(argv)


def _ensure_token() -> None:
    # The public CLI is the stable way to create ~/.ray/auth_token; a token already
    # given through RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH is respected as is.
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    if os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        return
    subprocess.run(["ray", "get-auth-token", "--generate"], check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    own_temp = args.temp_dir is None
    # Short path on purpose: Ray's unix sockets live under it and break past ~107 chars.
    temp_root = args.temp_dir or tempfile.mkdtemp(prefix="rtc-", dir="/tmp")
    # Ray records "the latest cluster" in <RAY_TMPDIR>/ray/ray_current_cluster and a bare
    # ray.init() anywhere on the machine attaches to it; pointing RAY_TMPDIR at a private
    # dir keeps other people's ray.init() (test sessions) starting their own cluster.
    os.environ["RAY_TMPDIR"] = temp_root
    # A stale RAY_ADDRESS would make helper code inside Ray talk to some other cluster.
    os.environ.pop("RAY_ADDRESS", None)
    if args.no_auth:
        os.environ["RAY_AUTH_MODE"] = "disabled"
    else:
        os.environ["RAY_AUTH_MODE"] = "token"
        _ensure_token()

    # Imported only now: Ray reads RAY_TMPDIR / RAY_AUTH_MODE when it loads its config.
    from ray.cluster_utils import Cluster

    head_cpus = args.cpus_per_node if args.head_cpus is None else args.head_cpus
    store = args.object_store_mb * 1024 * 1024
    head_args = dict(num_cpus=head_cpus, resources={"rtc_head": 1}, object_store_memory=store,
                     include_dashboard=args.dashboard_port is not None)
    if args.dashboard_port is not None:
        head_args["dashboard_port"] = args.dashboard_port

    stop = threading.Event()
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args=head_args)
        for i in range(args.workers):
            cluster.add_node(num_cpus=args.cpus_per_node, object_store_memory=store,
                             resources={"rtc_worker": 1, f"rtc_worker_{i}": 1})
        cluster.wait_for_nodes(timeout=120)
        address = cluster.address
        auth = "" if args.no_auth else "RAY_AUTH_MODE=token "
        lines = [
            f"Local Ray cluster up: 1 head ({head_cpus:g} CPU) + {args.workers} worker node(s) "
            f"({args.cpus_per_node:g} CPU each); session files under {temp_root}",
            f"  address:  {address}",
            f"  connect:  {auth}RAY_ADDRESS={address} python -m raytrain_ckpt run jobs/llama_debug_fsdp.yaml",
            f"  python:   ray.init(address='{address}')  (with {auth.strip() or 'no auth'} in the env)",
        ]
        if args.dashboard_port is not None:
            url = f"http://127.0.0.1:{args.dashboard_port}"
            lines.append(f"  submit:   {auth}ray job submit --address {url} --working-dir . -- "
                         "python -m raytrain_ckpt run jobs/llama_debug_fsdp.yaml")
        lines.append("Ctrl-C or SIGTERM shuts it down.")
        print("\n".join(lines), flush=True)
        if args.address_file:
            with open(args.address_file + ".tmp", "w") as f:
                f.write(address)
            # Rename so a poller never reads a half-written address.
            os.replace(args.address_file + ".tmp", args.address_file)
        # Installed only now: Ray's node objects put their own SIGTERM hook in place while
        # starting (it covers a signal during startup); from here on SIGTERM must run the
        # same orderly cleanup as Ctrl-C, workers first, or raylets could outlive us.
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        print("shutting down the local cluster ...", flush=True)
        return 0
    finally:
        # Ignore further signals so a second Ctrl-C cannot abandon half-stopped nodes.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if cluster is not None:
            cluster.shutdown()
        if own_temp:
            shutil.rmtree(temp_root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
