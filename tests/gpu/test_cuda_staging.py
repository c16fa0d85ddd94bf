"""Pinned shared-memory staging on CUDA: cudaHostRegister'd /dev/shm buffers filled by
non-blocking D2H copies on a side stream. Skipped without a GPU; needs only torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytrain_ckpt.checkpoint.datapath.staging import PinnedCudaStaging, allocate_buffer, map_buffer, plan_slots, slot_views

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _shm(name: str) -> Path:
    return Path("/dev/shm") / f"rtc-test-{name}.buf"


def _staging(tensors: dict[str, torch.Tensor], name: str) -> tuple[PinnedCudaStaging, Path, list, int]:
    slots, nbytes = plan_slots(tensors)
    path = _shm(name)
    allocate_buffer(path, nbytes)
    return PinnedCudaStaging(map_buffer(path, nbytes), slots, torch.device("cuda", 0)), path, slots, nbytes


def test_pinned_staging_copies_exactly_and_is_ordered_before_the_update() -> None:
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = {f"w{i}": torch.randn(1024, 1024, device=dev, generator=g).to(dtype)
               for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float32, torch.bfloat16])}
    expected = {k: v.cpu() for k, v in tensors.items()}
    staging, path, slots, nbytes = _staging(tensors, "exact")
    try:
        assert staging._registered  # the constructor raises when cudaHostRegister fails
        done: list[bool] = []
        staging.start(tensors, lambda: done.append(True))
        staging.wait()                      # what the trainer does right before optimizer.step()
        for v in tensors.values():          # the "optimizer step", on the current stream
            v.mul_(2).add_(1)
        torch.cuda.synchronize()
        staging.finish()                    # the hand-off (on_done) may run after wait() returned
        assert done == [True]
        writer_view = slot_views(map_buffer(path, nbytes), slots)   # what the writer process maps
        for k, v in expected.items():
            assert torch.equal(writer_view[k], v), k
    finally:
        staging.close()
        path.unlink(missing_ok=True)


def test_pinned_staging_returns_before_the_copy_is_done() -> None:
    dev = torch.device("cuda", 0)
    tensors = {f"w{i}": torch.randn(64, 1024, 1024, device=dev) for i in range(8)}  # 2 GiB
    staging, path, slots, nbytes = _staging(tensors, "overlap")
    try:
        done: list[bool] = []
        staging.start(tensors, lambda: done.append(True))
        assert staging._event is not None and not staging._event.query(), "start() waited for the D2H copy"
        assert staging.stream != torch.cuda.current_stream(dev)
        staging.wait()
        torch.cuda.synchronize()
        staging.finish()
        assert done == [True] and staging._event.query()
        view = slot_views(staging.buffer, slots)
        assert torch.equal(view["w7"][-1], tensors["w7"][-1].cpu())
    finally:
        staging.close()
        path.unlink(missing_ok=True)


if __name__ == "__main__":  # for machines without pytest
    test_pinned_staging_copies_exactly_and_is_ordered_before_the_update()
    test_pinned_staging_returns_before_the_copy_is_done()
    print("ok")
