"""``fsdp``: FSDP2, ``torch.distributed.fsdp.fully_shard`` (see the package docstring for the decisions)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from unison.contract.env import DistEnv
from unison.contract.ownership import (
    AccumulationOwner,
    GradAccumulation,
    LossNormalisation,
    Ownership,
    PrecisionOwner,
    StateDictDeclaration,
    StateDictKind,
)
from unison.contract.state import canonical
from unison.contract.transforms import checkpoint_blocks, compile_forward, compile_options, required_blocks
from unison.strategies.fsdp.common import (
    SHARDED_DCP,
    ShardedStrategy,
    precision_table,
    shard_units,
    sharding_policies,
)

#: Measured on CPU/gloo, world 2, torch 2.13 (MLP 8-32-32-1, AdamW lr 1e-2, 20
#: steps, accumulation 4, clipping at 0.5 that clips, StepLR); tests/test_fsdp.py
#: holds the ceilings.
_NOTES = (
    "32-true vs single: max abs parameter difference 3.4e-8 after 20 steps (ceiling 1e-5); grad norms rel 1e-7",
    (
        "bf16-mixed vs single's bf16-mixed (autocast): 3.8e-4 (ceiling 2e-3; bf16 vs fp32 itself differs by "
        "1.9e-2). The policy computes with bf16 copies of every parameter and keeps activations in bf16 between "
        "layers, where autocast keeps some ops in fp32"
    ),
    "16-mixed vs single's 16-mixed: 1.5e-4 (ceiling 1e-3); an fp16 overflow skips the same steps as single",
    (
        "bf16-true vs single's bf16-true: 3.9e-3 (ceiling 1e-2; bf16-true vs fp32 differs by 2.0e-2): gradients "
        "are reduce-scattered in bf16, so the two ranks' halves are summed with one more bf16 rounding"
    ),
    (
        "save at step 10 -> resume to 20 equals uninterrupted bitwise (0.0); the world-2 checkpoint resumed in "
        "one process under single or fsdp: 3e-8"
    ),
    "Sharding mutates the user's module in place (its class becomes an FSDP subclass, parameters DTensors)",
    "compile=...: each block's forward is compiled before it is sharded (torchtitan's per-block compile)",
)


class FSDP2Strategy(ShardedStrategy):
    """``torch.distributed.fsdp.fully_shard`` on a 1-D device mesh of the whole world.

    The user's module is sharded in place: parameters become DTensors sharded
    on dim 0, names do not change, so the optimizer, the DCP state-dict API and
    :meth:`full_state_dict` all see the module's own names.
    """

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            loss_normalisation=LossNormalisation(over="the data-parallel ranks: FSDP's reduce-scatter averages"),
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER,
                "no_sync() calls set_requires_gradient_sync(False) on non-boundary micro-steps: unsharded "
                "gradients accumulate locally and are reduce-scattered once, at the boundary",
            ),
            precision=precision_table(
                "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on every unit, "
                "output_dtype=float32 at the root: bf16 all-gather and compute, fp32 reduce-scatter, fp32 shards"
            ),
            state_dict=StateDictDeclaration(
                kind=StateDictKind.SHARDED,
                format=SHARDED_DCP,
                reshardable=True,
                canonical_export="full_tensor() of every DTensor in module.state_dict() (all-gather), cast to fp32, "
                "on CPU, on every rank",
            ),
            notes=_NOTES,
        )

    def wrap_module(self, module: torch.nn.Module) -> Any:
        # Mesh, per-unit sharding policies and the root are one sequence; the module is sharded in place (its
        # parameters become DTensors), so it is both what forward calls and what the optimizer trains.
        env, precision = self.env, self.precision
        assert env is not None and precision is not None
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            OffloadPolicy,
            fully_shard,
        )

        mesh = self._shard_mesh(env, module)
        self._policy_precision = (
            precision.support is not None and precision.support.owner is PrecisionOwner.SHARDING_POLICY
        )
        inner_mp, root_mp = sharding_policies(self._policy_precision)
        offload = (
            CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if self.options.cpu_offload else OffloadPolicy()
        )
        common = {"mesh": mesh, "reshard_after_forward": self.options.reshard_after_forward, "offload_policy": offload}
        # Children before parents: FSDP2 requires nested units to be sharded
        # bottom-up, and reversed pre-order visits every module after all of
        # its descendants.
        for _, unit in reversed(shard_units(module, self.options.shard_module_classes)):
            fully_shard(unit, mp_policy=inner_mp, **common)
        fully_shard(module, mp_policy=root_mp, **common)
        return module

    def validate_model(self, model: torch.nn.Module, settings: Any) -> None:
        super().validate_model(model, settings)
        if settings.compile is not False:
            required_blocks(model, "compile")  # compiled per block: refuse a model without any

    def apply_features(self, module: torch.nn.Module) -> None:
        """Activation checkpointing, then ``torch.compile`` of each block, before any ``fully_shard``.

        torchtitan's order and granularity: each block's forward is compiled on
        its own, so FSDP2's all-gather and reshard hooks (on the units around
        and inside it) stay outside the graphs, and the compiled blocks are
        sharded like any other module (names unchanged).
        """
        settings = self.settings
        assert settings is not None
        if settings.activation_checkpointing is not None:
            checkpoint_blocks(module, settings.activation_checkpointing)
        options = compile_options(settings.compile)
        if options is not None:
            for _, block in required_blocks(module, "compile"):
                compile_forward(block, options)

    def _shard_mesh(self, env: DistEnv, module: torch.nn.Module) -> Any:
        """The mesh ``fully_shard`` shards over: 1-D, the whole world.

        ``hsdp`` makes it 2-D; ``fsdp_tp`` first applies tensor parallel to ``module`` on its ``tp``
        dimension and returns the ``dp`` one (torchtitan's order: TP before FSDP).
        """
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(env.device.type, (env.world_size,))

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            # Back on for the boundary micro-step, even if this one raised.
            self.model.set_requires_gradient_sync(True)

    def no_sync(self) -> AbstractContextManager[Any]:
        return self._no_sync()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None
        params = [p for p in self.module.parameters() if p.grad is not None]
        # DTensor-aware: each rank's partial sum of squares over its shards is
        # all-reduced, so the norm (a replicated DTensor) is the global one.
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
        if max_norm is not None:
            # Takes the parameters (it reads .grad itself), not the gradients.
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        from torch.distributed.tensor import DTensor

        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        # module.state_dict() keeps the module's own names (tied parameters
        # under each name, as in a plain module); full_tensor() all-gathers.
        from torch.distributed.tensor import DTensor

        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.module.state_dict().items()}
        return canonical(state)
