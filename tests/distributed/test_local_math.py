"""The clip and the AdamW step on local shards (``parallel/local_math.py``) on real gloo ranks:
bit-identical to torch's AdamW and clip over FSDP2 DTensors, clipping for real, across the
pipeline group too, and through torch's own functions for layouts the local view cannot take."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

MAX_NORM = 0.05  # far below the gradients' norm: every step clips


def _sharded_pair(local: bool):
    """Two identically initialised FSDP2 models of uneven shapes (the shards differ in size)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(local: bool, steps: int = 4) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from raytrain_ckpt.parallel.local_math import LocalAdamW, clip_grad_norm_, local_views

    torch.set_num_threads(1)
    model = _sharded_pair(local)
    cls = LocalAdamW if local else torch.optim.AdamW
    opt = cls(model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    norms, taken = [], []
    for _ in range(steps):
        x = torch.randn(6, 7, generator=gen)
        model(x).pow(2).sum().mul(100).backward()
        params = list(model.parameters())
        if local:
            taken.append(local_views(p.grad for p in params) is not None)
            norm = clip_grad_norm_(params, MAX_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        norms.append(norm.clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {f"{n}": p.to_local().clone() for n, p in model.named_parameters()}
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            state[f"opt{i}.{k}"] = (v.to_local() if isinstance(v, DTensor) else v).clone()
    kinds = {type(v).__name__ for s in opt.state.values() for v in s.values()}
    return {"state": state, "norms": norms, "taken": taken, "kinds": kinds}


def both_ways() -> tuple[dict, dict]:
    return _train(local=False), _train(local=True)


def test_local_adamw_and_clip_are_bit_identical_to_torch_over_fsdp2_shards():
    for reference, local in run_ranks(both_ways, 2):
        assert all(local["taken"]), "FSDP2's gradients must take the local path"
        assert all(n > MAX_NORM for n in reference["norms"]), "the test must clip"
        assert [n.item() for n in local["norms"]] == [n.item() for n in reference["norms"]]
        assert reference["state"].keys() == local["state"].keys()
        for name, value in reference["state"].items():
            assert torch.equal(value, local["state"][name]), name
        assert "DTensor" in local["kinds"], "the optimizer's state stays DTensors (what DCP saves)"


def pipeline_clip() -> dict:
    """Each rank holds different parameters (its stage): the norm covers both stages."""
    import torch.distributed as dist
    from torch import nn

    from raytrain_ckpt.parallel.local_math import clip_grad_norm_

    rank = dist.get_rank()
    torch.manual_seed(rank)
    params = [nn.Parameter(torch.randn(4 + rank, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    grads = [p.grad.clone() for p in params]
    gathered: list = [None, None]
    dist.all_gather_object(gathered, grads)
    everything = [g for rank_grads in gathered for g in rank_grads]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in everything]))
    norm = clip_grad_norm_(params, 1.0, pp_group=dist.group.WORLD)
    return {"norm": norm.item(), "expected": expected.item(),
            "scaled": [torch.allclose(p.grad, g * (1.0 / (expected + 1e-6))) for p, g in zip(params, grads)]}


def test_clip_spans_the_pipeline_group():
    results = run_ranks(pipeline_clip, 2)
    assert results[0]["norm"] == results[1]["norm"]
    for r in results:
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-6)
        assert all(r["scaled"])


def replicated_falls_back() -> dict:
    """A replicated DTensor is not local-exact: the clip and the step go through DTensor."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from raytrain_ckpt.parallel.local_math import LocalAdamW, clip_grad_norm_, local_views

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for local in (False, True):
        torch.manual_seed(0)
        p = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Replicate()]))
        p.grad = distribute_tensor(torch.randn(4, 3) * 10, mesh, [Replicate()])
        opt = (LocalAdamW if local else torch.optim.AdamW)([p], lr=0.1)
        if local:
            out["view"] = local_views([p.grad])
            norm = clip_grad_norm_([p], 1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_([p], 1.0).full_tensor()
        opt.step()
        out[local] = (norm.item(), p.to_local().clone())
    return out


def test_a_layout_the_local_view_cannot_take_goes_through_dtensor():
    for r in run_ranks(replicated_falls_back, 2):
        assert r["view"] is None
        assert r[True][0] == r[False][0]
        assert torch.equal(r[True][1], r[False][1])
