"""The Trainer on CUDA with NCCL and bf16 FSDP2 compute. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from raytrain_ckpt.control.preflight import load_spec
from tests.distributed.launch import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def train_cuda(spec_json: str, steps: int) -> dict:
    import time

    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    trainer = Trainer(JobSpec.model_validate_json(spec_json), torch.device("cuda", torch.cuda.current_device()))
    start = None
    for i in range(steps):
        if i == 2:  # skip warmup steps (allocator, kernels) when timing
            torch.cuda.synchronize()
            start = time.monotonic()
        report = trainer.train_step()
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    dtypes = {p.dtype for p in trainer.model.parameters()}
    return {"losses": trainer.state.losses, "step_s": elapsed / (steps - 2), "dtypes": dtypes,
            "backend": torch.distributed.get_backend(), "tokens_per_s": report.tokens_per_s}


def _spec(model: str, *extra: str) -> str:
    base = [f"model.name={model}", "resources.use_gpu=true", "resources.num_workers=1", "parallelism.dp_shard=1",
            "training.log_every_steps=1", "lr_scheduler.warmup_steps=2"]
    return load_spec("jobs/llama_debug_fsdp.yaml", base + list(extra)).model_dump_json()


def test_nccl_bf16_debug_model_trains():
    out = run_ranks(train_cuda, 1, _spec("debug", "training.steps=30"), 30, backend="nccl")[0]
    assert out["backend"] == "nccl"
    assert out["dtypes"] == {torch.float32}  # sharded master weights stay fp32; compute is bf16
    assert out["losses"][30] < out["losses"][1] - 0.5
    print(f"debug: {out['step_s'] * 1000:.1f} ms/step")


def test_nccl_bf16_small_model_throughput():
    spec = _spec("small", "training.steps=12", "training.seq_len=1024", "training.global_batch_size=16",
                 "training.micro_batch_size=8")
    out = run_ranks(train_cuda, 1, spec, 12, backend="nccl")[0]
    assert out["losses"][12] < out["losses"][1]
    print(f"small (25M) seq 1024 gbs 16: {out['step_s'] * 1000:.1f} ms/step, {out['tokens_per_s']:.0f} tokens/s")
