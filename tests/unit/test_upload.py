"""The S3 upload from the staging buffer (a real S3 endpoint: moto's server on 127.0.0.1) writes
the same bytes as the local one-pass writer, part by part, and a failed part leaves no object."""

from __future__ import annotations

from pathlib import Path

import crc32c
import fsspec
import pytest
import torch

from raytrain_ckpt.checkpoint.datapath.localfile import write_rank_files
from raytrain_ckpt.checkpoint.datapath.staging import StagedPlanner, map_slots
from raytrain_ckpt.checkpoint.datapath.upload import is_s3, upload_rank_files
from tests.unit.test_filewrite import _plan_and_stage

PART = 5 << 20
"""S3's smallest part: the 12 MiB file below is three parts."""


def _staged(shm: Path):
    g = torch.Generator().manual_seed(5)
    state = {"model": {"big": torch.randn(3 << 20, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
                       "empty": torch.zeros(0, 4)}, "step": 3}
    plan, _, owned, slots, nbytes, objects = _plan_and_stage(state, shm)
    return plan, owned, {**map_slots(owned.path, nbytes, slots), **objects}


def _fs(url: str, **extra) -> object:
    return fsspec.filesystem("s3", endpoint_url=url, key="testing", secret="testing", skip_instance_cache=True,
                             use_listings_cache=False, **extra)


@pytest.mark.parametrize("threads", [1, 2])
def test_uploaded_files_are_the_local_files_byte_for_byte(s3_endpoint, s3_bucket, tmp_path: Path,
                                                          threads: int) -> None:
    plan, owned, staged = _staged(tmp_path)
    fs = _fs(s3_endpoint.url)
    assert is_s3(fs)
    try:
        local = tmp_path / "local"
        local.mkdir()
        expected = write_rank_files(local, plan, StagedPlanner(staged).resolve_data, threads)
        uploaded = upload_rank_files(fs, f"{s3_bucket}/step", plan, StagedPlanner(staged).resolve_data, threads,
                                     part_size=PART, inflight=2)
    finally:
        owned.remove()
    assert uploaded.files == expected.files
    assert sorted(map(str, uploaded.results)) == sorted(map(str, expected.results))
    for name, entry in uploaded.files.items():
        data = fs.cat_file(f"{s3_bucket}/step/{name}")
        assert data == (local / name).read_bytes()
        assert (len(data), crc32c.crc32c(data)) == (entry["size"], entry["crc32c"])
    big = max(uploaded.files.values(), key=lambda f: f["size"])
    assert big["size"] > 2 * PART  # the multipart path ran, with more parts than may be in flight
    assert fs.call_s3("list_multipart_uploads", Bucket=s3_bucket[5:]).get("Uploads", []) == []


def test_a_failing_part_aborts_the_upload_and_leaves_no_object(s3_endpoint, s3_bucket, flaky_s3,
                                                               tmp_path: Path) -> None:
    plan, owned, staged = _staged(tmp_path)
    flaky_s3.fail(10**6, every=1, methods=("PUT",))  # every part (and PUT) fails; creating and aborting work
    fs = _fs(flaky_s3.url, config_kwargs={"retries": {"max_attempts": 1}})
    fs.retries = 1  # s3fs's own retries of a failed call
    try:
        with pytest.raises(Exception) as raised:
            upload_rank_files(fs, f"{s3_bucket}/step", plan, StagedPlanner(staged).resolve_data, 1,
                              part_size=PART, inflight=2)
    finally:
        owned.remove()
    assert flaky_s3.failed >= 1, repr(raised.value)
    direct = _fs(s3_endpoint.url)
    assert direct.call_s3("list_multipart_uploads", Bucket=s3_bucket[5:]).get("Uploads", []) == []
    assert not direct.exists(f"{s3_bucket}/step/__0_0.distcp")


def test_parts_refused_or_dropped_in_transit_are_sent_again(s3_endpoint, s3_bucket, flaky_s3, tmp_path: Path) -> None:
    plan, owned, staged = _staged(tmp_path)
    flaky_s3.fail(2, every=2, methods=("PUT",))  # the 2nd part PUT gets a 503 SlowDown, the 4th a reset
    fs = _fs(flaky_s3.url)
    try:
        local = tmp_path / "local"
        local.mkdir()
        expected = write_rank_files(local, plan, StagedPlanner(staged).resolve_data, 1)
        uploaded = upload_rank_files(fs, f"{s3_bucket}/step", plan, StagedPlanner(staged).resolve_data, 1,
                                     part_size=PART, inflight=2)
    finally:
        owned.remove()
    assert flaky_s3.failed == 2
    assert uploaded.files == expected.files
    for name in uploaded.files:
        assert fs.cat_file(f"{s3_bucket}/step/{name}") == (local / name).read_bytes()
