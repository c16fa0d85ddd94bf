"""Per-rank memory estimate of a job, from the model's shape alone (no torch: ``validate`` uses it).

Approximate by design, meant to catch a layout that cannot fit, not to predict the peak:

- parameters, gradients: fp32, sharded by FSDP2 over the data-parallel ranks and split by the
  pipeline over its stages, so 1/(dp_shard x pp) of the model each (every replica group holds
  a whole copy);
- optimizer: AdamW two fp32 moments, SGD one with momentum, a user optimizer counted as AdamW;
- staging: an async checkpoint copies the rank's parameters and optimizer state to host memory
  (pinned on GPU, shared memory on CPU) before writing it, into ``checkpoint.memory_copies``
  buffers (the second keeps the newest committed step for a restart from memory);
- replica: with ``checkpoint.replication.mode: auto`` a node also holds its predecessor's ranks'
  committed copies: about one more copy of the state per rank, in host memory;
- activations: what one micro-batch keeps for backward in the compute dtype (bf16 on GPU unless
  fp32 is asked), per layer of this rank's stage: ``8 dim + 3 kv + 4 ffn`` values per token for
  a block that keeps its activations, ``dim`` for a checkpointed one (plus one block's worth
  while it is recomputed), and the logits with their fp32 loss copy and gradient. A pipeline
  stage holds up to ``pp`` micro-batches in flight with 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_ckpt.models import describe_model
from raytrain_ckpt.models.config import LlamaConfig
from raytrain_ckpt.spec.job import JobSpec

__all__ = ["MemoryEstimate", "memory_estimate", "spare_reserve_bytes", "storage_line"]

_GIB = 1 << 30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs, by what holds them."""

    parameters: int
    gradients: int
    optimizer: int
    staging: int
    """Host memory for an async checkpoint's copies of the rank's state (0 for sync or no checkpointing)."""
    activations: int
    staging_copies: int = 1
    """How many staging buffers ``staging`` counts (``checkpoint.memory_copies``)."""
    replica: int = 0
    """Host memory for a peer node's committed copy (``checkpoint.replication``), per rank."""
    spare: int = 0
    """Host memory each spare worker holds for a rank's optimizer state (``spare_reserve_bytes``)."""

    @property
    def device(self) -> int:
        """Bytes on the training device (the GPU, or host RAM on CPU)."""
        return self.parameters + self.gradients + self.optimizer + self.activations

    def lines(self, where: str) -> list[str]:
        """Human-readable lines, one per part and a total."""
        parts = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer", self.optimizer),
                 ("activations", self.activations)]
        out = [f"memory per rank (estimate): {self.device / _GIB:.2f} GiB on {where}"]
        out += [f"  {name:<12} {value / _GIB:8.2f} GiB" for name, value in parts]
        what = "async checkpoint copy" if self.staging_copies == 1 else \
            f"async checkpoint, {self.staging_copies} buffers: the newest committed step stays in memory for restarts"
        out.append(f"  {'staging':<12} {self.staging / _GIB:8.2f} GiB of host memory ({what})")
        if self.spare:
            out.append(f"  {'spare':<12} {self.spare / _GIB:8.2f} GiB of host memory per spare worker "
                       "(fault_tolerance.spare_workers: a rank's optimizer state, touched ahead for a takeover)")
        if self.replica:
            out.append(f"  {'replica':<12} {self.replica / _GIB:8.2f} GiB of host memory (a peer node's rank's "
                       "committed copy, checkpoint.replication)")
        return out


def memory_estimate(spec: JobSpec) -> MemoryEstimate | None:
    """The per-rank estimate for ``spec``; None for a user factory, whose shape is unknown."""
    cfg = describe_model(spec.model.name, spec.model.overrides)
    if cfg is None:
        return None
    shard = cfg.num_params // (spec.world_size // spec.parallelism.dp_replicate)  # each replica group: a whole model
    optimizer = shard * _optimizer_bytes_per_param(spec)
    ckpt = spec.checkpoint
    staging = (shard * 4 + optimizer) * ckpt.memory_copies if ckpt.enabled and ckpt.mode == "async" else 0
    replica = shard * 4 + optimizer if staging and ckpt.replication.mode == "auto" else 0
    return MemoryEstimate(parameters=shard * 4, gradients=shard * 4, optimizer=optimizer, staging=staging,
                          activations=_activation_bytes(spec, cfg), staging_copies=ckpt.memory_copies,
                          replica=replica, spare=_spare_reserve(spec, optimizer))


def storage_line(spec: JobSpec) -> str | None:
    """The checkpoint root's space at its fullest under retention (None: no checkpoints, or a
    user factory): ``keep_latest_k`` steps, the newest certified step kept beside them while the
    training guard is on (until a newer one is certified), and the step being written."""
    cfg = describe_model(spec.model.name, spec.model.overrides)
    ckpt = spec.checkpoint
    if cfg is None or not ckpt.enabled:
        return None
    step = cfg.num_params * (4 + _optimizer_bytes_per_param(spec))
    if ckpt.keep_latest_k is None:
        return f"checkpoint storage (estimate): {step / _GIB:.2f} GiB per step, every step kept (keep_latest_k=null)"
    guard = spec.training.guard.nonfinite or spec.training.guard.spike
    steps = ckpt.keep_latest_k + int(guard) + 1
    parts = [f"keep_latest_k={ckpt.keep_latest_k}"] + (["1 newest certified step (training.guard)"] if guard else [])
    more = ", plus keep_every_n_steps and keep_best" if ckpt.keep_every_n_steps or ckpt.keep_best else ""
    return (f"checkpoint storage (estimate): {steps} steps x {step / _GIB:.2f} GiB = {steps * step / _GIB:.2f} GiB "
            f"({' + '.join(parts)} + 1 step being written{more})")


def spare_reserve_bytes(spec: JobSpec) -> int:
    """What a spare worker touches ahead for the optimizer state of the rank it may take over
    (``checkpoint.state.StateReserve``); 0: none.

    Only where spares run (a CPU job that may restart and reuses workers), a takeover loads a
    checkpoint (checkpointing on), and the model's size is known (built-in presets): the
    estimate's optimizer state, 2% and 1 MiB over, since FSDP2's first ranks hold a row more of
    each tensor than the average.
    """
    est = memory_estimate(spec)
    return 0 if est is None else est.spare


def _spare_reserve(spec: JobSpec, optimizer: int) -> int:
    ft = spec.fault_tolerance
    spares = ft.spare_workers > 0 and ft.reuse_workers and ft.max_restarts > 0 and not spec.resources.use_gpu
    if not (spares and spec.checkpoint.enabled and optimizer):
        return 0
    return int(optimizer * 1.02) + (1 << 20)


def _optimizer_bytes_per_param(spec: JobSpec) -> int:
    o = spec.optimizer
    if o.name == "sgd":
        return 4 if o.momentum else 0
    return 8


def _activation_bytes(spec: JobSpec, cfg: LlamaConfig) -> int:
    t, par = spec.training, spec.parallelism
    elem = 4 if t.mixed_precision == "fp32" or (t.mixed_precision == "auto" and not spec.resources.use_gpu) else 2
    tokens = t.micro_batch_size * t.seq_len
    kv = cfg.n_kv_heads * cfg.head_dim
    full_block = 8 * cfg.dim + 3 * kv + 4 * cfg.ffn_dim
    layers = -(-cfg.n_layers // par.pp)
    checkpointed = {"none": 0, "full": layers, "selective": -(-layers // 2)}[t.activation_checkpointing]
    per_token = (layers - checkpointed) * full_block + checkpointed * cfg.dim
    if checkpointed:
        per_token += full_block  # the block being recomputed in backward
    blocks = tokens * per_token * elem * par.pp  # up to pp micro-batches in flight on a stage
    logits = tokens * cfg.vocab_size * (elem + 4 + 4)  # logits, their fp32 copy, its gradient
    return blocks + logits
