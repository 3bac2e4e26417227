"""The options and the ownership declarations of ``apex_distributed_fused_adam``."""

from __future__ import annotations

import pydantic

from unison.contract.ownership import (
    PrecisionOwner,
    PrecisionSupport,
    StateDictDeclaration,
    StateDictKind,
)


class DistributedFusedAdamOptions(pydantic.BaseModel):
    """Options of ``apex_distributed_fused_adam``; each is passed to ``DistributedFusedAdam`` as is."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    bucket_cap_mb: float = pydantic.Field(100.0, gt=0)
    """Bucket size of the gradient reduce-scatter and the parameter all-gather (apex's default: 100)."""
    overlap_grad_sync: bool = True
    """Reduce-scatter a bucket as soon as its gradients are ready, overlapping the boundary backward."""
    pipeline_size: int = pydantic.Field(2, ge=1)
    """Buckets processed at a time in the step and while gathering the state dict."""
    contiguous_param_buffer: bool = False
    """Make parameters views into one persistent buffer (fewer copies, maybe more memory)."""
    contiguous_grad_buffer: bool = False
    """Allocate gradient buckets from one persistent buffer."""
    store_params: bool = True
    """Keep a copy of this rank's parameter shard in the optimizer (apex's default)."""
    distributed_size: int | None = pydantic.Field(None, ge=1)
    """Shard optimizer state over groups of this many consecutive ranks and replicate it across the groups
    (apex's distributed and redundant process groups); ``None``: shard over every rank."""


PRECISION = {
    "32-true": PrecisionSupport(
        PrecisionOwner.TRAINER,
        "fp32 parameters; DistributedFusedAdam keeps fp32 moments and reduce-scatters and all-gathers in fp32",
    ),
    "bf16-mixed": PrecisionSupport(
        PrecisionOwner.TRAINER, "torch.autocast(bfloat16) by the trainer; parameters, gradients and moments stay fp32"
    ),
    "16-mixed": PrecisionSupport(
        PrecisionOwner.TRAINER,
        "torch.autocast(float16) + a GradScaler by the trainer whose unscaling is DistributedFusedAdam.unscale_grads "
        "(the gradients live in the optimizer's buckets, not in param.grad); an overflow, found from the global "
        "grad norm, skips the step on every rank",
    ),
    "bf16-true": PrecisionSupport.unsupported(
        "bf16-true keeps the optimizer state in bf16 too; DistributedFusedAdam's bf16-parameter mode keeps fp32 "
        "moments and an fp32 master copy of each shard (store_params / store_param_remainders), which is mixed "
        "precision with master weights, not bf16-true: use bf16-mixed"
    ),
}

STATE = StateDictDeclaration(
    kind=StateDictKind.FULL,
    format=(
        "torch.distributed.checkpoint (DCP) in the ddp/single layout: module parameters by name, optimizer state as "
        "torch AdamW (Adam in L2 mode) state keyed by parameter name; DistributedFusedAdam.state_dict() (format 2) "
        "gathers the sharded moments on every rank to write it, and load_state_dict scatters them back"
    ),
    reshardable=True,
    canonical_export=(
        "module.state_dict() on every rank (DistributedFusedAdam all-gathers the updated parameters at the end of "
        "every step, so each rank holds them whole), fp32, CPU"
    ),
)
