"""Shared fixtures: one local Ray cluster for the whole session."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def ray_tmpdir(prefix: str = "rtc-") -> str:
    """A private ``RAY_TMPDIR`` (or other directory) for a cluster of a test's own: short, under
    /tmp (Ray's socket paths have a length limit), removed when the process that made it exits."""
    import atexit

    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    atexit.register(shutil.rmtree, path, True)
    return path


FILE_SECONDS = REPO / "tests" / "file_seconds.json"
"""Each test file's measured serial time (``scripts/file_seconds.py`` writes it from a
``--durations=0`` log); it orders the files, longest first."""


def _file_seconds() -> dict[str, float]:
    import json

    try:
        return {str(k): float(v) for k, v in json.loads(FILE_SECONDS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def pytest_collection_modifyitems(items):
    """A test on the session's Ray is an integration test wherever it lives, so the fast tier
    (``-m "not integration"``) never starts Ray.

    Files run longest first (a stable sort: the tests of a file keep their order). On
    ``pytest-xdist`` workers with ``--dist loadfile --no-loadscope-reorder`` (``scripts/test.sh``)
    each idle worker takes the next file of this order, so the long files start at once and the
    short ones fill the end (a file not yet measured counts as the median file)."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
    seconds = _file_seconds()
    median = sorted(seconds.values())[len(seconds) // 2] if seconds else 0.0
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], median))


_SESSION_SHM: list[Path] = []
"""This session's staging directory, once ``results_dir`` made it."""


@pytest.fixture(scope="session", autouse=True)
def results_dir(tmp_path_factory):
    """The default checkpoint location (``~/raytrain_results`` for a user) is a temporary directory:
    a test never writes into the real home directory. Set first (autouse, session), so the local
    Ray and every subprocess a test starts inherit it."""
    path = tmp_path_factory.mktemp("raytrain_results")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYTRAIN_CKPT_RESULTS", str(path))
        # the pre-scan's verdicts (checkpoint/format/scancache.py) are kept out of ~/.cache too
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        # Staging buffers of this session go to a directory of its own in /dev/shm (still RAM, still
        # real files): the leak check below sees only what this session made, and a writer's sweep
        # of orphans never reaches another session's buffers (nor theirs ours).
        shm = Path(tempfile.mkdtemp(prefix="raytrain-tests-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        mp.setenv("RAYTRAIN_CKPT_SHM_DIR", str(shm))
        _SESSION_SHM[:] = [shm]
        yield path
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster(results_dir):
    """A real local Ray (4 logical CPUs so 2-4 rank worlds fit on a 2-core machine)."""
    import ray

    # The workers import this checkout (and tests.*): the path goes in the environment the local
    # Ray's processes inherit at start, and only for them (every other subprocess of the session
    # sets up its own path, as a user's would).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


LEAK_GRACE_S = 10.0
"""How long the leak check waits for teardown that is asynchronous (``ray.kill`` returns before the
GCS marks the actor dead; a writer unlinks its buffers as it exits) before it calls a leftover a leak."""
_LIVE_ACTOR_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "ALIVE", "RESTARTING")


def _live_actors() -> dict[str, str]:
    """Every actor of the session's Ray that is not dead: id -> a line naming it."""
    from ray._private import state

    live = {}
    for name in _LIVE_ACTOR_STATES:
        for actor_id, a in state.actors(actor_state_name=name).items():
            named = f" named {a['Name']!r}" if a["Name"] else ""
            live[actor_id] = (f"actor {a['ActorClassName']}{named}{' (detached)' if a['IsDetached'] else ''}"
                              f" {name} pid {a['Pid']}")
    return live


def _live_placement_groups() -> dict[str, str]:
    """Every placement group of the session's Ray that is not removed: id -> a line naming it."""
    from ray.util import placement_group_table

    return {pg_id: f"placement group {pg['name'] or pg_id[:12]} {pg['state']} bundles {list(pg['bundles'].values())}"
            for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}


def _staging_files() -> dict[str, str]:
    """Every file in this session's staging directory (``RAYTRAIN_CKPT_SHM_DIR``, set above; read
    from the session's own record, so a test that changes the variable does not move the check)."""
    shm = _SESSION_SHM[0]
    return {str(p): f"staging file {p}" for p in shm.rglob("*") if not p.is_dir()}


def leftovers(before: dict[str, str], probes, grace_s: float | None = None) -> dict[str, str]:
    """What ``probes`` see now that was not in ``before``, polled for ``grace_s`` (``LEAK_GRACE_S``)
    until it is gone."""
    deadline = time.monotonic() + (LEAK_GRACE_S if grace_s is None else grace_s)
    while True:
        now = {k: v for probe in probes for k, v in probe().items() if k not in before}
        if not now or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def nothing_left_behind(request):
    """Fails a test that leaves a Ray actor or placement group of the session's Ray alive, or a
    staging buffer file of this session, that was not there before it (module fixtures set up
    before it count as before). Ray is looked at only for tests that use the session's Ray."""
    probes = [_staging_files]
    if "ray_cluster" in request.fixturenames:
        request.getfixturevalue("ray_cluster")
        probes += [_live_actors, _live_placement_groups]
    before = {k: v for probe in probes for k, v in probe().items()}
    yield
    if len(probes) > 1 and not request.getfixturevalue("ray_cluster").is_initialized():
        probes = probes[:1]  # a test that shut the session's Ray down left nothing of it alive
    left = leftovers(before, probes)
    if left:
        pytest.fail(f"{request.node.nodeid} left behind (still there {LEAK_GRACE_S:.0f} s after it ended):\n  "
                    + "\n  ".join(sorted(left.values())), pytrace=False)


REFERENCE_20 = ["training.steps=20", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "training.seq_len=32",
                "checkpoint.enabled=true", "checkpoint.interval_steps=5", "checkpoint.keep_latest_k=null",
                "fault_tolerance.max_restarts=0"]
"""The demo job at 32-token sequences, 20 steps, a checkpoint every 5: the uninterrupted run the
checkpoint, memory-restore and object-store tests compare their faulted runs with."""


@pytest.fixture(scope="session")
def reference_20_run(ray_cluster, tmp_path_factory):
    """``REFERENCE_20`` run once, uninterrupted: (its result, its checkpoint directory). Its
    parameters, optimizer state and losses do not depend on where the checkpoints went or how many
    are kept, so every module that runs the same job with a fault compares with it."""
    from raytrain_ckpt.control.controller import JobState
    from raytrain_ckpt.control.driver import run_job
    from raytrain_ckpt.control.preflight import load_spec

    ckpt_dir = tmp_path_factory.mktemp("reference-20")
    result = run_job(load_spec(REPO / "jobs" / "llama_debug_fsdp.yaml", [*REFERENCE_20, f"checkpoint.dir={ckpt_dir}"]))
    assert result.state is JobState.SUCCEEDED, result.error
    return result, ckpt_dir


@pytest.fixture(scope="session")
def reference_20(reference_20_run):
    """The result of the uninterrupted ``REFERENCE_20`` run."""
    return reference_20_run[0]


# Ray forwards actors' log lines to the driver's stderr on its own schedule, so a test that runs
# the CLI in the same process after a Ray job may find them mixed into what it captured.
_RAY_FORWARDED = re.compile(r"^(\x1b\[\d+m)?\((raylet[^)]*|\w+(\(.*\))? pid=\d+[^)]*)\)")


@pytest.fixture
def cli_stderr(capsys):
    """What the CLI itself wrote to stderr, without lines Ray forwarded from actors."""
    def read() -> str:
        err = capsys.readouterr().err
        return "".join(line for line in err.splitlines(keepends=True) if not _RAY_FORWARDED.match(line))
    return read


class S3Endpoint:
    """A real S3 HTTP endpoint (moto's server) on 127.0.0.1 with fake credentials."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": url}
        self.options = {"endpoint_url": url, "key": "testing", "secret": "testing"}
        """``checkpoint.storage_options`` for this endpoint (for processes that lack ``env``)."""

    def new_bucket(self) -> str:
        """A fresh, empty bucket; returns ``s3://<name>``."""
        import uuid

        import boto3

        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}"


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server (``moto[server]``, what s3fs's own tests use) on a free port of 127.0.0.1,
    with its endpoint and fake credentials in this process's environment (boto reads them)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = S3Endpoint(f"http://{host}:{port}")
    saved = {k: os.environ.get(k) for k in endpoint.env}
    os.environ.update(endpoint.env)
    yield endpoint
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    """``s3://<fresh bucket>`` on the session's S3 endpoint."""
    return s3_endpoint.new_bucket()


class FlakyS3:
    """An HTTP proxy in front of the S3 endpoint that fails chosen requests the way S3 does when
    it is overloaded: ``503 SlowDown`` replies and connections reset without a reply.

    ``fail(n, every, methods)``: of the requests with one of ``methods``, every ``every``-th
    fails, ``n`` in all, alternating 503 and reset. ``failed`` counts the injected failures.
    """

    def __init__(self, upstream: str) -> None:
        import http.server
        import threading
        import urllib.parse

        self.upstream = urllib.parse.urlsplit(upstream)
        self.failed = 0
        self._left, self._every, self._methods, self._seen = 0, 1, ("PUT", "POST"), 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: pytest shows failures, not traffic
                pass

            def _any(self) -> None:
                proxy._forward(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def fail(self, n: int, every: int = 1, methods: tuple[str, ...] = ("PUT", "POST")) -> None:
        with self._lock:
            self._left, self._every, self._methods, self._seen = n, every, methods, 0

    def _verdict(self, method: str) -> str | None:
        with self._lock:
            if self._left <= 0 or method not in self._methods:
                return None
            self._seen += 1
            if self._seen % self._every:
                return None
            self._left -= 1
            self.failed += 1
            return "503" if self.failed % 2 else "reset"

    def _forward(self, h) -> None:
        import http.client

        body = self._body(h)
        verdict = self._verdict(h.command)
        if verdict == "reset":
            h.close_connection = True
            h.connection.close()
            return
        if verdict == "503":
            msg = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                   b'<Message>Please reduce your request rate.</Message></Error>')
            h.send_response(503)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(msg)))
            h.end_headers()
            h.wfile.write(msg)
            return
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "transfer-encoding",
                                                                                 "content-length", "expect")}
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                h.send_header(k, v)
        # a HEAD reply has no body but the length of the object it describes
        h.send_header("Content-Length", resp.getheader("Content-Length", "0") if h.command == "HEAD" else str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    @staticmethod
    def _body(h) -> bytes | None:
        """The request body, de-chunked when the client streams it (forwarded with a length)."""
        if "chunked" not in h.headers.get("Transfer-Encoding", "").lower():
            length = int(h.headers.get("Content-Length") or 0)
            return h.rfile.read(length) if length else None
        parts = []
        while size := int(h.rfile.readline().split(b";")[0].strip() or b"0", 16):
            parts.append(h.rfile.read(size))
            h.rfile.readline()
        while h.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return b"".join(parts)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def flaky_s3(s3_endpoint):
    """A fault-injecting proxy in front of the session's S3 endpoint (see ``FlakyS3``)."""
    proxy = FlakyS3(s3_endpoint.url)
    yield proxy
    proxy.close()
