"""Shared fixtures: one local Ray cluster for the whole session."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray (4 logical CPUs so 2-4 rank worlds fit on a 2-core machine)."""
    import ray

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}},
             log_to_driver=True)
    yield ray
    ray.shutdown()


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
