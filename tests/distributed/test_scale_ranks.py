"""The simulated ranks of ``bench/scale.py`` plan what real ranks plan (real gloo ranks, the real trainer).

The scale benchmark drives the coordinator with thousands of local save plans computed from a
model's shape; its figures mean something only if those plans are the ones real ranks send.
Here two real ranks build the trainer (FSDP2 over gloo, AdamW, the schedule), take ``app_state``
and run DCP's planner; the simulation's plan for each rank must be equal, item for item.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from bench.scale_ranks import local_plan, template
from raytrain_ckpt.models.factory import describe_model
from raytrain_ckpt.control.preflight import load_spec
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed


def _spec(*extra: str):
    return load_spec("jobs/llama_debug_fsdp.yaml", ["training.steps=2", "lr_scheduler.warmup_steps=1",
                                                    "training.global_batch_size=4", "training.micro_batch_size=2",
                                                    "training.seq_len=16", *extra])


def real_local_plan(spec_json: str) -> bytes:
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from raytrain_ckpt.checkpoint.recovery.state import app_state
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(JobSpec.model_validate_json(spec_json), torch.device("cpu"))
    trainer.train_step()  # the optimizer's state as training made it, not as the simulation creates it
    planner = DefaultSavePlanner()
    planner.set_up_planner(app_state(trainer), is_coordinator=dist.get_rank() == 0)
    return pickle.dumps(planner.create_local_plan())


def test_a_simulated_rank_plans_what_a_real_rank_plans() -> None:
    # n_heads=2, n_kv_heads=1 and dim=96 make wk/wv's first dimension odd-sized per rank's
    # chunk arithmetic (48 rows of 2 ranks; ffn 288): uneven shards are where the rule matters.
    spec = _spec("model.overrides.dim=96", "model.overrides.n_heads=2", "model.overrides.n_kv_heads=1",
                 "model.overrides.ffn_dim=200", "model.overrides.vocab_size=255")
    real = [pickle.loads(b) for b in run_ranks(real_local_plan, 2, spec.model_dump_json())]
    shape = template(spec, describe_model(spec.model.name, spec.model.overrides))
    for rank in range(2):
        simulated = local_plan(shape, rank, 2)
        assert [i.index.fqn for i in simulated.items] == [i.index.fqn for i in real[rank].items]
        assert simulated.items == real[rank].items, rank
        assert simulated.planner_data == real[rank].planner_data
        assert simulated == real[rank]
    sizes = {i.tensor_data.chunk.sizes[0] for p in real for i in p.items if i.index.fqn == "model.output.weight"}
    assert sizes == {128, 127}, sizes  # vocab 255 over 2 ranks: the shards really are uneven
