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


def sent_plan(spec_json: str) -> bytes:
    """What a real rank's checkpoint client sends the coordinator of its first save's plan
    (``planning.plan_to_send``: one broadcast of rank 0's plan over the real process
    group), and the local plan it stands for."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from raytrain_ckpt.checkpoint.recovery.state import app_state
    from raytrain_ckpt.checkpoint.roles.planning import plan_to_send
    from raytrain_ckpt.rank.trainer import Trainer
    from raytrain_ckpt.spec import JobSpec

    torch.set_num_threads(1)
    trainer = Trainer(JobSpec.model_validate_json(spec_json), torch.device("cpu"))
    trainer.train_step()
    planner = DefaultSavePlanner()
    planner.set_up_planner(app_state(trainer), is_coordinator=dist.get_rank() == 0)
    local, sent = plan_to_send(planner.create_local_plan, dist.get_rank(), torch.device("cpu"))
    return pickle.dumps((sent, local))


def test_real_ranks_send_their_plans_as_differences_and_get_dcps_global_plan() -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    from raytrain_ckpt.checkpoint.format.planchecks import global_plan
    from raytrain_ckpt.checkpoint.format.plannumbers import PlanNumbers, SharedPlan, own_central
    from raytrain_ckpt.checkpoint.roles.planning import GatheredPlans

    world = 4
    spec = _spec("model.overrides.dim=96", "model.overrides.n_heads=2", "model.overrides.n_kv_heads=1",
                 "model.overrides.ffn_dim=200", "model.overrides.vocab_size=255", "training.global_batch_size=8",
                 "resources.num_workers=4", "parallelism.dp_shard=4")
    got = [pickle.loads(b) for b in run_ranks(sent_plan, world, spec.model_dump_json())]
    sent, local = [g[0] for g in got], [g[1] for g in got]
    assert isinstance(sent[0], SharedPlan) and all(isinstance(s, PlanNumbers) and s.against == 0 for s in sent[1:])
    assert all(len(pickle.dumps(s)) * 3 < len(pickle.dumps(p)) for s, p in zip(sent[1:], local[1:]))
    gathered = GatheredPlans()
    for r in (2, 0, 3, 1):
        gathered.add(r, sent[r])
    parts, metadata = gathered.build(world, False)
    want, want_metadata = global_plan(local)
    want = FileSystemWriter("/unused").prepare_global_plan([p.__class__(p.items, p.storage_data, None, p.usable)
                                                            for p in want])
    assert metadata == want_metadata
    for r in range(world):
        assert own_central(parts[r], local[r]) == want[r]
        assert [i.index.index for i in own_central(parts[r], local[r]).items] == [i.index.index for i in want[r].items]
