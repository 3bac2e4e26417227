"""``fsdp`` (FSDP2, ``fully_shard``), ``hsdp`` (replicate x shard), ``fsdp_tp`` (dp x tp) and ``fsdp1``.

Both shard parameters, gradients and optimizer state across the data-parallel
world (ZeRO-3 style) and keep the trainer in charge of gradient accumulation:
on non-boundary micro-steps the trainer enters :meth:`no_sync`, which turns the
per-step reduce-scatter off, so gradients are reduced once per optimizer step,
exactly like ``ddp`` with ``no_sync()``.

A package by concern: :mod:`.common` holds what both share (options, the
sharding-unit choice, precision tables, the sharded grad scaler, the base
:class:`~.common.ShardedStrategy`), :mod:`.fsdp2` and :mod:`.fsdp1` one
strategy each, :mod:`.hsdp` FSDP2 on a 2-D mesh, :mod:`.tensor_parallel` FSDP2 x tensor parallel;
this module registers all four.

Decisions shared by both:

* **Which submodules become their own sharding unit.** ``shard_module_classes``
  names classes (``type(m).__name__``). By default every submodule that
  *directly* owns parameters (``Linear``, ``Conv*``, ``Embedding``,
  ``LayerNorm`` ...) is one unit, because that is the finest grain that works
  for any model without knowing its block structure; models with repeated
  blocks should name the block class (fewer, larger collectives). A
  submodule whose parameters are shared with a module outside it (tied
  weights) is never its own unit: FSDP requires a shared parameter to live in
  exactly one unit, so it stays with the root. The root is always sharded, so
  every parameter is managed.
* **bf16-mixed belongs to the sharding policy** (``MixedPrecisionPolicy`` /
  ``MixedPrecision``): parameters are all-gathered and used in bf16, gradients
  are reduced and kept in fp32 against fp32 sharded master parameters. That is
  where FSDP saves the communication; autocast over fp32 all-gathers would not.
  The root's outputs are returned in fp32 so that the user's loss runs in fp32,
  as it does under the single reference's autocast.
* **16-mixed belongs to the trainer**: ``torch.autocast(float16)`` over fp32
  sharded parameters with a *sharded* loss scaler from :meth:`make_grad_scaler`
  (``ShardedGradScaler``: each rank checks its own gradient shards for
  inf/nan and the flag is all-reduced, so every rank skips the same steps).
  A policy-owned fp16 (``MixedPrecisionPolicy(float16)``) would need the
  strategy to own loss scaling, overflow skips and scaler state as well; the
  trainer already does all three for every trainer-applied precision, so the
  strategy supplies only the scaler that understands shards.
* **bf16-true belongs to the trainer**: the module is cast to bf16 before it is
  sharded, so shards, gradients (reduced in bf16) and optimizer state are bf16.
* **State**: sharded DCP checkpoints through ``torch.distributed.checkpoint``
  (:func:`unison.contract.state.dcp_save`): the state-dict API hands DCP each rank's
  DTensor shards, each rank writes its own, keys are the module's own names,
  and DCP reshards on load, so a checkpoint written at world size 2 loads at
  1, into ``single`` or ``ddp``, and theirs into ``fsdp``.
"""

from __future__ import annotations

from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec
from unison.strategies.fsdp.common import FSDPOptions
from unison.strategies.fsdp.fsdp1 import FSDP1Strategy
from unison.strategies.fsdp.fsdp2 import FSDP2Strategy
from unison.strategies.fsdp.hsdp import HSDPOptions, HSDPStrategy
from unison.strategies.fsdp.tensor_parallel import FSDPTPOptions, FSDPTPStrategy


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="fsdp",
            factory=FSDP2Strategy,
            description="FSDP2 fully_shard: parameters, gradients and optimizer state sharded; sharded DCP checkpoints",
            options=FSDPOptions,
        ),
        StrategySpec(
            name="hsdp",
            factory=HSDPStrategy,
            description="FSDP2 on a 2-D mesh: sharded within groups of shard_size ranks, replicated across them",
            options=HSDPOptions,
        ),
        StrategySpec(
            name="fsdp_tp",
            factory=FSDPTPStrategy,
            description="tensor parallel (the model's tp_plan) on a tp mesh dimension, FSDP2 on dp",
            options=FSDPTPOptions,
        ),
        StrategySpec(
            name="fsdp1",
            factory=FSDP1Strategy,
            description="FullyShardedDataParallel (use_orig_params=True); sharded DCP checkpoints",
            options=FSDPOptions,
        ),
    ]
