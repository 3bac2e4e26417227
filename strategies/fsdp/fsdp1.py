"""``fsdp1``: ``torch.distributed.fsdp.FullyShardedDataParallel`` (see the package docstring for the decisions)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from unison.contract.env import resolve_accelerator
from unison.contract.ownership import (
    AccumulationOwner,
    Feature,
    GradAccumulation,
    LossNormalisation,
    Ownership,
    PrecisionOwner,
    StateDictDeclaration,
    StateDictKind,
)
from unison.contract.state import canonical
from unison.contract.strategy import OptimizerFactory
from unison.errors import ConfigurationError
from unison.strategies.fsdp.common import (
    SHARDED_DCP,
    ShardedStrategy,
    precision_table,
    shard_units,
)

#: Why ``fsdp1`` refuses the module features: it applies neither (its flat-parameter wrapper is not certified
#: with them).
FSDP1_FEATURE = (
    "fsdp1 (FullyShardedDataParallel, flat parameters) is kept for existing runs and applies neither torch.compile "
    "nor activation checkpointing; use fsdp (FSDP2), which compiles and checkpoints per block"
)

_NOTES = (
    "32-true vs single: max abs parameter difference 4.5e-8 after 20 steps (ceiling 1e-5); grad norms rel 1e-7",
    "bf16-mixed vs single's bf16-mixed (autocast): 1.2e-3 (ceiling 2e-3; bf16 vs fp32 itself differs by 1.9e-2)",
    "16-mixed vs single's 16-mixed: 1.5e-4 (ceiling 1e-3); an fp16 overflow skips the same steps as single",
    (
        "bf16-true vs single's bf16-true: 2.9e-3 (ceiling 1e-2; bf16-true vs fp32 differs by 2.0e-2): gradients "
        "are reduce-scattered in bf16"
    ),
    (
        "save at step 10 -> resume to 20 equals uninterrupted bitwise (0.0); the world-2 checkpoint resumed in "
        "one process under single or fsdp1: 3e-8"
    ),
    (
        "cpu_offload is refused on a CPU device: FullyShardedDataParallel pins offloaded shards (pin_memory), "
        "which raises without an accelerator; fsdp (FSDP2) accepts it"
    ),
    "Auto-wrapping replaces the chosen submodules of the user's module by FullyShardedDataParallel wrappers",
)


class FSDP1Strategy(ShardedStrategy):
    """``torch.distributed.fsdp.FullyShardedDataParallel`` with ``use_orig_params=True``.

    ``use_orig_params=True`` keeps the original parameters visible (as views
    of the local flat shard), so the optimizer is built on them and the DCP
    state-dict API keys model and optimizer state by the module's own names.
    """

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            loss_normalisation=LossNormalisation(over="the data-parallel ranks: FSDP's reduce-scatter averages"),
            refuses={Feature.COMPILE: FSDP1_FEATURE, Feature.ACTIVATION_CHECKPOINTING: FSDP1_FEATURE},
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER,
                "FullyShardedDataParallel.no_sync() on non-boundary micro-steps: unsharded gradients accumulate "
                "locally and are reduce-scattered once, at the boundary",
            ),
            precision=precision_table(
                "MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32): bf16 all-gather and compute, "
                "fp32 reduce-scatter and fp32 flat shards; root outputs cast to fp32"
            ),
            state_dict=StateDictDeclaration(
                kind=StateDictKind.SHARDED,
                format=SHARDED_DCP,
                reshardable=True,
                canonical_export="torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True) "
                "on the FSDP root (all-gather, FSDP prefixes removed), cast to fp32, on CPU, on every rank",
            ),
            notes=_NOTES,
        )

    def build(self, module: torch.nn.Module, make_optimizer: OptimizerFactory) -> tuple[Any, torch.optim.Optimizer]:
        # The optimizer before the wrapper (see below), then the mesh, the per-unit policy and the root in one
        # sequence: not the default wrap-then-optimizer order.
        env, precision = self.env, self.precision
        assert env is not None and precision is not None
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffload,
            FullyShardedDataParallel,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp.wrap import CustomPolicy

        self._canonical_keys = list(module.state_dict().keys())
        # With a device mesh, FSDP1's sharded state dict holds DTensors rather
        # than ShardedTensors. Not optional: DCP drops a ShardedTensor that has
        # no local shard on a rank (a parameter with fewer rows than ranks,
        # e.g. a Linear(..., 1) head), mistakes the checkpoint for a pre-2.4
        # layout and fails the resume with "Missing key ... optim.param_groups".
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        units = {id(m) for _, m in shard_units(module, self.options.shard_module_classes)}
        self._policy_precision = (
            precision.support is not None and precision.support.owner is PrecisionOwner.SHARDING_POLICY
        )
        # cast_forward_inputs: every unit casts its floating inputs to bf16, as
        # FSDP2 does; otherwise an fp32 activation (e.g. after adding an fp32
        # buffer) would meet bf16 weights in the next unit.
        mixed = (
            MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
            if self._policy_precision
            else None
        )
        # The optimizer is built on the original parameters *before* wrapping:
        # with use_orig_params=True FSDP keeps these Parameter objects and only
        # swaps their data for 1-D shard views, so a factory that groups by
        # shape (``p.ndim >= 2`` decays, as in nanoGPT) sees the real shapes.
        # Built after wrapping, every parameter looked 1-D and landed in the
        # no-decay group (a conformance failure of the lr_scheduler scenario).
        optimizer = make_optimizer(module.parameters())
        model = FullyShardedDataParallel(
            module,
            auto_wrap_policy=CustomPolicy(lambda m: id(m) in units),
            sharding_strategy=ShardingStrategy.FULL_SHARD
            if self.options.reshard_after_forward
            else ShardingStrategy.SHARD_GRAD_OP,
            cpu_offload=CPUOffload(offload_params=True) if self.options.cpu_offload else None,
            mixed_precision=mixed,
            device_id=env.device,
            device_mesh=mesh,
            use_orig_params=True,
        )
        wrapped = {id(p) for p in model.parameters()}
        if any(id(p) not in wrapped for group in optimizer.param_groups for p in group["params"]):
            raise RuntimeError("FullyShardedDataParallel replaced parameters the optimizer holds; cannot continue")
        # Adagrad makes its state in its constructor, shaped like the whole parameters; FSDP has since
        # replaced each parameter's data with this rank's 1-D shard. That state is dropped, all of it
        # on every rank (a tiny parameter's shard can keep its shape on one rank only, and ranks whose
        # optimizers differ in having state diverge in the checkpoint's collectives): the optimizer
        # makes it again at its first step, over the shard (torch's Adagrad from its defaults, as its
        # constructor did). A factory's optimizer has no other state.
        optimizer.state.clear()
        return model, optimizer

    def validate(self, settings: Any, world_size: int) -> None:
        if self.options.cpu_offload and resolve_accelerator(settings.accelerator) == "cpu":
            # Measured (torch 2.13): FSDP1 pins the offloaded flat shards with
            # pin_memory(), which raises "Cannot access accelerator device when
            # none is available" at the first forward. Refuse up front instead.
            raise ConfigurationError(
                "strategy_options.cpu_offload",
                f"strategy {self.name!r} (FullyShardedDataParallel) pins offloaded shards in page-locked memory, "
                "which needs an accelerator; this run trains on the CPU",
                "drop cpu_offload on CPU (the shards already live in host memory), or use strategy 'fsdp', "
                "whose CPUOffloadPolicy works on a CPU device",
            )

    def no_sync(self) -> AbstractContextManager[Any]:
        return self.model.no_sync()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        # FSDP1 all-reduces the shards' squared norms: the returned norm is
        # global. With no limit, clip at +inf: the coefficient clamps to 1.0
        # and the gradients are multiplied by exactly 1 (unchanged).
        norm = self.model.clip_grad_norm_(float("inf") if max_norm is None else max_norm)
        # Stays on the device: a copy to the host here would synchronise every step.
        return norm.detach().float()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        # cpu_offload=False: with it, only rank 0 would receive the state.
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        if sorted(state) != sorted(self._canonical_keys):
            raise RuntimeError(
                f"fsdp1 exported keys {sorted(state)} differ from the module's own {sorted(self._canonical_keys)}"
            )
        return canonical({k: state[k] for k in self._canonical_keys})
