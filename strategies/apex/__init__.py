"""``apex_distributed_fused_adam``: NVIDIA apex's ``DistributedFusedAdam`` (sharded Adam), CUDA only.

What NVIDIA apex offers today, read from its source at commit
``6424da3b4faa6c8f062da4a48c424fff3f02d42d`` (2026-07): ``apex.amp`` and
``apex.parallel.DistributedDataParallel`` are gone; what remains for training
loops is fused optimizers (``apex.optimizers.FusedAdam``, ``FusedLAMB``, ...:
plain ``torch.optim.Optimizer`` subclasses, usable under any strategy, see
docs/strategies.md) and ``apex.contrib.optimizers.distributed_fused_adam.DistributedFusedAdam``,
a ZeRO-2 style optimizer that owns gradient synchronisation. This module
registers the latter as a strategy.

(Why one file above 400 lines: one strategy, whose optimizer owns gradient
sync, clipping and sharded state; about half of the file is this docstring's
ownership table and the conversion between its buckets and canonical state.)

Who owns what
-------------
There is no module wrapper: the optimizer hooks each parameter's gradient
accumulator.

===================  ==========================================================
accumulation         trainer, synchronised at the boundary: micro-steps but the
                     last run inside ``optimizer.no_sync()`` (gradients add up in
                     ``param.grad``); on the last, the optimizer's hooks copy
                     each gradient into its bucket and reduce-scatter
                     (``ReduceOp.AVG``) every bucket as it fills, overlapping the
                     backward; ``grad_sync()`` (inside the norm and the step)
                     finishes the rest
gradients            the optimizer's, as shards: after the boundary backward
                     ``param.grad`` is ``None``; this rank holds the averaged
                     gradient of its shard of every bucket
clipping             ``optimizer.clip_grad_norm(max_norm)``: the global norm
                     (shard norms all-reduced), the clip factor folded into the
                     next step; without clipping ``optimizer.grad_norm()``
optimizer step       ``optimizer.step()``: Adam on this rank's shard, then an
                     all-gather of the updated parameters (every rank ends the
                     step with whole, equal parameters)
precision            the trainer's (autocast; for fp16 a GradScaler whose
                     unscaling is ``optimizer.unscale_grads``); fp32 parameters,
                     moments and communication
state_dict           ``optimizer.state_dict()`` (format 2) gathers the sharded
                     moments on every rank; written in the ddp/single DCP
                     format, so it resumes under any strategy and world size
replica init         the trainer (``DistributedFusedAdam`` broadcasts parameters
                     too, but not buffers)
===================  ==========================================================

The user's optimizer
--------------------
The trainer hands strategies a factory. ``DistributedFusedAdam`` is an Adam, so
the factory's optimizer is read as a recipe: ``torch.optim.AdamW``,
``torch.optim.Adam`` (L2 weight decay, or decoupled with
``decoupled_weight_decay=True``) and ``apex.optimizers.FusedAdam`` map onto it
(per parameter group: ``lr``, ``betas``, ``eps``, ``weight_decay``,
``bias_correction``; ``adam_w_mode`` from the class), and anything else is refused
before any process group (:meth:`DistributedFusedAdamStrategy.validate_optimizer`).
The factory's instance is not stepped; the step hooks registered on it are
registered on the ``DistributedFusedAdam``. Frozen parameters are left out:
``DistributedFusedAdam`` treats a missing gradient as zero and would still move
them by momentum and weight decay.

Not exposed, and why
--------------------
``overlap_param_sync`` (experimental in apex; it patches ``torch.nn.Parameter``'s
class), ``store_param_remainders`` and ``with_scaled_states`` (bf16 or
low-precision state: see ``bf16-true`` below), ``nccl_ub`` and ``capturable``
(NCCL user buffers, CUDA graphs), ``average_grad_sync=False`` (the trainer
divides the loss for accumulation once and expects gradients averaged over
replicas), and non-fp32 ``dtype`` / ``grad_sync_dtype`` / ``param_sync_dtype``
(they change the numbers the conformance suite compares).

Layout
------
A package by concern: :mod:`.availability` (is apex usable here, without
importing it), :mod:`.declaration` (options, precision and state
declarations), :mod:`.adam` (the user's optimizer as DistributedFusedAdam
takes it), :mod:`.strategy` (setup, hot path, checkpoints); this module
registers the strategy.
"""

from __future__ import annotations

from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec
from unison.strategies.apex.adam import adam_hyperparameters
from unison.strategies.apex.availability import CUDA_ONLY, NOT_INSTALLED, distributed_fused_adam_unavailable
from unison.strategies.apex.declaration import DistributedFusedAdamOptions
from unison.strategies.apex.strategy import DistributedFusedAdamStrategy

__all__ = [
    "CUDA_ONLY",
    "NOT_INSTALLED",
    "DistributedFusedAdamOptions",
    "DistributedFusedAdamStrategy",
    "adam_hyperparameters",
    "distributed_fused_adam_unavailable",
    "unison_strategies",
]


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="apex_distributed_fused_adam",
            factory=DistributedFusedAdamStrategy,
            description="NVIDIA apex DistributedFusedAdam: optimizer state and gradients sharded by the "
            "optimizer (CUDA)",
            options=DistributedFusedAdamOptions,
            unavailable=distributed_fused_adam_unavailable(),
        )
    ]
