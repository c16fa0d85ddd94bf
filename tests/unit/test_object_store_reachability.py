"""An object store that cannot be used (wrong endpoint, an endpoint that never answers, no
credentials, no such bucket) is one line and exit 2 from every command that takes a URI, found
in seconds: real sockets, a real S3 endpoint (moto's server) and the real CLI in a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.storage.objects import object_store_problem

REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket closes


@pytest.fixture
def silent_endpoint():
    """A TCP endpoint that accepts connections and never answers (a firewall that eats replies)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)  # the kernel completes the handshakes; nobody ever reads or replies
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def _env(env: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return base | {"AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                   "AWS_EC2_METADATA_DISABLED": "true", "PYTHONPATH": str(REPO)} | env


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return _clis([list(args)], env)[0]


def _clis(commands: list[list[str]], env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """The CLI commands, run at the same time (a refused connection is retried with back-off
    for seconds, mostly asleep): their results in order."""
    procs = [subprocess.Popen([sys.executable, "-m", "raytrain_ckpt", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(env)) for args in commands]
    results = []
    for args, proc in zip(commands, procs):
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return results


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def test_a_silent_endpoint_is_reported_at_the_timeout(silent_endpoint):
    t0 = time.monotonic()
    problem = object_store_problem("s3://bucket/job", {"endpoint_url": silent_endpoint, "key": "k", "secret": "s"},
                                   timeout_s=2)
    assert time.monotonic() - t0 < 10
    assert problem is not None and "no answer from the object store within 2 s" in problem
    assert "AWS_ENDPOINT_URL" in problem


def test_a_reachable_bucket_passes_and_a_missing_one_is_named(s3_endpoint):
    bucket = s3_endpoint.new_bucket()
    assert object_store_problem(f"{bucket}/runs/new-job", s3_endpoint.options) is None
    assert object_store_problem(bucket, s3_endpoint.options) is None
    assert object_store_problem("s3://no-such-bucket-here/job", s3_endpoint.options) == \
        "s3://no-such-bucket-here/job: the bucket does not exist; create it or fix the URI"


def test_every_uri_command_refuses_an_unreachable_endpoint_in_one_line(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    commands = [["ls", "s3://bucket/job"], ["status", "s3://bucket/job"], ["verify", "s3://bucket/job/step-00000002"],
                ["export", "s3://bucket/job", "--out", str(tmp_path / "export")]]
    results = _clis(commands, env={"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
    for command, proc in zip(commands, results):
        line = _one_error_line(proc)
        assert "cannot use the object store (EndpointConnectionError" in line and url in line, command
    assert not (tmp_path / "export").exists()


def test_missing_credentials_are_named(s3_endpoint):
    line = _one_error_line(_cli("ls", f"{s3_endpoint.new_bucket()}/job", env={"AWS_ENDPOINT_URL": s3_endpoint.url}))
    assert "NoCredentialsError" in line and "AWS_ACCESS_KEY_ID" in line


def test_a_job_spec_on_an_unreachable_store_is_refused_before_anything_starts(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: t\ncheckpoint:\n  enabled: true\n  dir: s3://bucket/ckpt\n"
                    f"  storage_options: {{endpoint_url: '{url}', key: k, secret: s}}\n")
    for proc in _clis([["validate", str(spec)], ["run", str(spec)]], env={}):
        line = _one_error_line(proc)
        assert line.startswith("error: checkpoint.dir=s3://bucket/ckpt: cannot use the object store "
                               "(EndpointConnectionError"), line
