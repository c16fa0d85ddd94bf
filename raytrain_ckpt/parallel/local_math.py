"""The gradient clip and the AdamW step on each rank's local shards instead of through DTensor.

FSDP2 leaves parameters, gradients and AdamW's state as DTensors sharded over the ``dp_shard``
mesh. AdamW is elementwise, so each rank's step over its local shards is the step DTensor
would run (the same aten ops on the same local tensors); the clip needs one global number,
the 2-norm over every gradient, which is each tensor's local norm reduced over the shards.
Running both on ``to_local()`` views skips DTensor's dispatch and its sharding propagation,
which a process fills per operator and shape on its first step: in a restart, the warm
spare's first step (ARCHITECTURE, "The optimizer step and the clip run on local shards").

Only layouts where the local view is exact are taken: every tensor a DTensor placed only
with ``Shard`` on one 1-D mesh, or no DTensor at all. Anything else (a replicated or partial
placement, several meshes) goes through torch's own functions, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.optim.adam import adam

__all__ = ["LocalAdamW", "clip_grad_norm_", "local_views"]


def local_views(tensors: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], dist.ProcessGroup | None] | None:
    """The local tensors of ``tensors`` and the group their shards are spread over.

    ``(views, group)`` when every tensor is a DTensor sharded (``Shard`` only) over one 1-D
    mesh (``group`` is that mesh's), ``(tensors, None)`` when none is a DTensor, and None for
    any other layout (the caller then goes through DTensor).
    """
    tensors = list(tensors)
    dtensors = [t for t in tensors if isinstance(t, DTensor)]
    if not dtensors:
        return tensors, None
    if len(dtensors) != len(tensors):
        return None
    mesh = dtensors[0].device_mesh
    if mesh.ndim != 1 or any(t.device_mesh != mesh or not all(isinstance(p, Shard) for p in t.placements)
                             for t in dtensors):
        return None
    return [t.to_local() for t in dtensors], mesh.get_group()


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip every gradient to the global 2-norm ``max_norm``; returns that norm (a plain tensor).

    The norm covers every shard (summed over the shards' group) and, with ``pp_group``, every
    pipeline stage (the squared norms summed over that group). Each tensor's norm is reduced
    before the norms are combined, the order DTensor's own clip reduces them in.
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    local = local_views(grads)
    if local is None:
        return _clip_through_dtensor(params, grads, max_norm, pp_group)
    views, shard_group = local
    if views:
        norms = torch.stack(torch._foreach_norm(views, 2.0))
        if shard_group is not None:  # each tensor's norm over its shards, as DTensor reduces a sharded norm
            norms = norms**2
            dist.all_reduce(norms, op=dist.ReduceOp.SUM, group=shard_group)
            norms = norms ** (1.0 / 2.0)
        total = torch.linalg.vector_norm(norms, 2.0)
    else:
        total = torch.zeros((), dtype=torch.float32)
    if pp_group is not None:
        total = total**2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        total = total.sqrt()
    if views:
        torch._foreach_mul_(views, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def _clip_through_dtensor(params: list[torch.nn.Parameter], grads: list[torch.Tensor], max_norm: float,
                          pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    if pp_group is None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = norm**2
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)
    norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class LocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs torch's AdamW on the local shards (see the module).

    Parameters and state stay DTensors: ``state_dict``, DCP and every caller see an AdamW.
    A param group whose tensors are not all local-exact (``local_views``) steps as AdamW does.
    """

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        if closure is not None:
            raise ValueError("LocalAdamW.step takes no closure")
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            views = [local_views(ts) for ts in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)]
            if any(v is None for v in views):
                views = [(ts, None) for ts in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)]
            (p, _), (g, _), (m, _), (v, _), (vmax, _) = views  # type: ignore[misc]
            beta1, beta2 = group["betas"]
            adam(p, g, m, v, vmax, steps, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1,
                 beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
                 differentiable=group["differentiable"], fused=group["fused"],
                 grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                 decoupled_weight_decay=group["decoupled_weight_decay"])
        return None
