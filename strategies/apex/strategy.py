"""``apex_distributed_fused_adam``: the strategy (setup, hot path, checkpoints); see the package docstring."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from unison._upstream.apex import release_grad_accumulators
from unison._upstream.torch import copy_step_hooks
from unison.contract.ownership import (
    AccumulationOwner,
    Feature,
    GradAccumulation,
    GradSync,
    LossNormalisation,
    Ownership,
    ReplicaInit,
    WorldSizes,
)
from unison.contract.settings import TrainerSettings
from unison.contract.state import canonical
from unison.contract.strategy import OptimizerFactory, Strategy
from unison.strategies.apex.adam import adam_hyperparameters, scalar, shadow_class
from unison.strategies.apex.declaration import PRECISION, STATE, DistributedFusedAdamOptions


class _UnscaleThroughOptimizer(torch.amp.GradScaler):
    """A GradScaler whose unscaling is ``DistributedFusedAdam.unscale_grads``.

    torch's GradScaler unscales ``param.grad``, which ``DistributedFusedAdam``
    has already moved into its buckets. ``unscale_grads(inv_scale=...)`` folds
    the inverse scale into the next step and returns the overflow flag per
    device, from the global grad norm: the same on every rank. Overriding
    ``_unscale_grads_`` (as torch's own ``ShardedGradScaler`` does) keeps the
    rest of GradScaler's bookkeeping (stages, ``update``).
    """

    def _unscale_grads_(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        return optimizer.unscale_grads(inv_scale=inv_scale)


#: Why ``apex_distributed_fused_adam`` refuses the module features: its own setup applies neither.
APEX_FEATURE = (
    "this strategy's setup (no module wrapper, gradient hooks per parameter) applies neither torch.compile nor "
    "activation checkpointing; use ddp or fsdp"
)


class DistributedFusedAdamStrategy(Strategy):
    """apex's ``DistributedFusedAdam`` over the user's module (see the module docstring)."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = DistributedFusedAdamOptions(**options)
        #: The factory's optimizer: its parameter groups define the checkpoint layout.
        self._recipe: torch.optim.Optimizer | None = None
        self._adam_w_mode = True

    # -- declaration ------------------------------------------------------------ #
    @property
    def ownership(self) -> Ownership:
        size = self.options.distributed_size
        world_sizes = (
            WorldSizes()
            if size is None
            else WorldSizes(
                minimum=size,
                multiple_of=size,
                reason=f"distributed_size={size} shards the optimizer over groups of {size} ranks",
            )
        )
        return Ownership(
            loss_normalisation=LossNormalisation(
                over="the distributed group: reduce-scatter with ReduceOp.AVG",
                scaled_by=(
                    "DistributedFusedAdam.unscale_grads(inv_scale=factor) folds the factor into the next step "
                    "(gradients live in its buckets)"
                ),
            ),
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER,
                "DistributedFusedAdam.no_sync() on non-boundary micro-steps (gradients add up in param.grad); on the "
                "last, the optimizer's post-backward hooks reduce-scatter each bucket as it fills, and grad_sync() "
                "finishes the rest before the norm",
                sync=GradSync.BOUNDARY,
            ),
            precision=PRECISION,
            state_dict=STATE,
            replica_init=ReplicaInit.TRAINER,
            world_sizes=world_sizes,
            # Checked by validate_optimizer, before any process group.
            refuses={
                Feature.ANY_OPTIMIZER: "it trains with DistributedFusedAdam, an Adam optimizer: the factory must "
                "return torch.optim.AdamW, torch.optim.Adam or apex.optimizers.FusedAdam",
                Feature.COMPILE: APEX_FEATURE,
                Feature.ACTIVATION_CHECKPOINTING: APEX_FEATURE,
            },
            notes=(
                "gradient sync: no module wrapper; hooks on each parameter's gradient accumulator reduce-scatter "
                "(ReduceOp.AVG) over the distributed group, then all-reduce over the redundant group",
                "clipping: DistributedFusedAdam.clip_grad_norm(max_norm), the global norm of the sharded gradients; "
                "the clip factor is applied inside the next step",
                "optimizer: torch Adam/AdamW or apex FusedAdam from the factory is read as a recipe (lr, betas, eps, "
                "weight_decay, parameter groups); any other optimizer is refused before any process group; frozen "
                "parameters are left out; step hooks on the factory's optimizer are registered on DistributedFusedAdam",
                "a parameter that gets no gradient in a step is updated with a zero gradient (momentum and weight "
                "decay still move it), where torch's Adam skips it",
                "buffers are made equal once, before training; there is no module wrapper to synchronise them "
                "afterwards, so buffers a forward updates (BatchNorm statistics) follow each rank's own data",
                "CUDA only (NCCL); memory_footprint()['optimizer_state'] is this rank's shard",
            ),
        )

    def validate_optimizer(self, optimizer: torch.optim.Optimizer, settings: TrainerSettings) -> None:
        adam_hyperparameters(optimizer, strategy=self.name)

    # -- setup -------------------------------------------------------------------- #
    def build_optimizer(self, make_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        """DistributedFusedAdam with the factory's Adam hyper-parameters (the base's setup moved the module
        and left it unwrapped: the optimizer itself synchronises gradients)."""
        env, module = self.env, self.module
        assert env is not None and module is not None
        # All parameters, as ddp passes them: the factory's groups (frozen
        # parameters included) are the layout of the ddp/single checkpoint.
        recipe = make_optimizer(module.parameters())
        self._adam_w_mode, defaults, options = adam_hyperparameters(recipe, strategy=self.name)
        groups = [
            dict(opts, params=[p for p in group["params"] if p.requires_grad])
            for group, opts in zip(recipe.param_groups, options)
        ]
        distributed_group, redundant_group = self._process_groups()
        from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

        optimizer = DistributedFusedAdam(
            groups,
            **defaults,
            adam_w_mode=self._adam_w_mode,
            device=env.device,
            distributed_process_group=distributed_group,
            redundant_process_group=redundant_group,
            # The trainer divides the loss once and expects gradients averaged over replicas.
            average_grad_sync=True,
            overlap_grad_sync=self.options.overlap_grad_sync,
            bucket_cap_mb=self.options.bucket_cap_mb,
            pipeline_size=self.options.pipeline_size,
            contiguous_param_buffer=self.options.contiguous_param_buffer,
            contiguous_grad_buffer=self.options.contiguous_grad_buffer,
            store_params=self.options.store_params,
        )
        # Lay the buckets out now, in reverse parameter order: apex would do it
        # lazily in the order gradients first arrive, but load_state_dict lays
        # out in parameter order, and a layout that differs after a resume sums
        # the grad norm's shards in another order (resume would not be exact).
        # Reverse order approximates the order gradients arrive in a backward,
        # which keeps the reduce-scatter overlapped with it.
        optimizer.init_params(list(reversed([p for group in groups for p in group["params"]])))
        # Step hooks the user registered on the factory's optimizer fire on the one that steps.
        copy_step_hooks(recipe, optimizer)
        self._recipe = recipe
        return optimizer

    def _process_groups(self) -> tuple[Any, Any]:
        """``(distributed_process_group, redundant_process_group)``; ``(None, None)`` shards over the world."""
        env = self.env
        assert env is not None
        size = self.options.distributed_size
        if size is None or size == env.world_size:
            return None, None
        rank, distributed, redundant = env.rank, None, None
        # new_group is collective: every rank creates every group, in the same order.
        for start in range(0, env.world_size, size):
            ranks = list(range(start, start + size))
            group = torch.distributed.new_group(ranks)
            distributed = group if rank in ranks else distributed
        for offset in range(size):
            ranks = list(range(offset, env.world_size, size))
            group = torch.distributed.new_group(ranks)
            redundant = group if rank in ranks else redundant
        return distributed, redundant

    # -- hot path ------------------------------------------------------------------ #
    def no_sync(self) -> AbstractContextManager[Any]:
        assert self.optimizer is not None
        return self.optimizer.no_sync()  # DistributedFusedAdam's own

    def scale_gradients(self, factor: torch.Tensor) -> None:
        # The reduced gradients live in the optimizer's buckets; it folds the factor into the next step, and
        # grad_norm()/clip_grad_norm() report the scaled norm.
        optimizer: Any = self.optimizer
        optimizer.unscale_grads(inv_scale=factor)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        optimizer: Any = self.optimizer
        # Both return the global pre-clip norm (unscaled after unscale_grads).
        if max_norm is None:
            return optimizer.grad_norm()
        return optimizer.clip_grad_norm(max_norm)

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        # Also resets the optimizer's pending gradient scale and cached norm.
        self.optimizer.zero_grad(set_to_none=True)

    def make_grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        return _UnscaleThroughOptimizer(device.type)

    # -- state ---------------------------------------------------------------------- #
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        # Parameters are all-gathered at the end of every step: every rank holds them whole.
        return canonical(self.module.state_dict())

    def _shadow(self) -> torch.optim.Optimizer:
        """A plain torch Adam(W) over the factory's groups, holding the DistributedFusedAdam's group values.

        Group ``i`` of the shadow is group ``i`` of the factory's optimizer
        (frozen parameters included); its values (``lr``, ``betas``, ... and
        whatever a scheduler added, e.g. ``initial_lr``) are the
        DistributedFusedAdam's group ``i``, less ``bias_correction``: torch's
        Adam has no such key, and a ddp/single checkpoint none to load into it
        (it is configuration, read again from the factory at resume).
        """
        assert self._recipe is not None and self.optimizer is not None
        groups = [
            {
                **{k: v for k, v in live.items() if k not in ("params", "bias_correction")},
                "params": list(user["params"]),
            }
            for user, live in zip(self._recipe.param_groups, self.optimizer.param_groups)
        ]
        return shadow_class(self._adam_w_mode)(groups)

    def save_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        # Format 2 (apex's default): the whole state, gathered on every rank, on the CPU.
        full = self.optimizer.state_dict()
        shadow = self._shadow()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        step = torch.tensor(float(full["state"]["step"]))
        for index, param in enumerate(params):
            saved = full["state"][index]
            shadow.state[param] = {
                "step": step.clone(),
                "exp_avg": saved["exp_avg"].to(param.device),
                "exp_avg_sq": saved["exp_avg_sq"].to(param.device),
            }
        state = {"model": get_model_state_dict(self.module), "optim": get_optimizer_state_dict(self.module, shadow)}
        dcp.save(state, checkpoint_id=str(directory))

    def load_state(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.module is not None and self.optimizer is not None
        shadow = self._shadow()
        # The template names every tensor the checkpoint must provide.
        state = {"model": get_model_state_dict(self.module), "optim": get_optimizer_state_dict(self.module, shadow)}
        dcp.load(state, checkpoint_id=str(directory))
        set_model_state_dict(self.module, state["model"])
        set_optimizer_state_dict(self.module, shadow, state["optim"])
        self.optimizer.load_state_dict(self._format2(shadow))

    def _format2(self, shadow: torch.optim.Optimizer) -> dict[str, Any]:
        """The shadow's state as a ``DistributedFusedAdam`` state dict of format 2 (index-keyed, on the CPU)."""
        assert self.optimizer is not None
        state: dict[Any, Any] = {}
        groups: list[dict[str, Any]] = []
        steps: list[int] = []
        index = 0
        for live, loaded in zip(self.optimizer.param_groups, shadow.param_groups):
            ids = []
            for param in live["params"]:
                saved = shadow.state.get(param, {})
                zeros = torch.zeros_like(param, dtype=torch.float32, device="cpu")
                state[index] = {
                    # With store_params the optimizer holds its own copy of the parameters: the loaded ones.
                    "param": param.detach().float().cpu(),
                    "exp_avg": saved["exp_avg"].float().cpu() if "exp_avg" in saved else zeros,
                    "exp_avg_sq": saved["exp_avg_sq"].float().cpu() if "exp_avg_sq" in saved else zeros.clone(),
                }
                if "step" in saved:
                    steps.append(int(scalar(saved["step"])))
                ids.append(index)
                index += 1
            # The live group's keys take the loaded values (lr, betas ...) and keys a
            # scheduler added (initial_lr ...) come along; the shadow class's own
            # flags (amsgrad, foreach ...) do not.
            values = {k: v for k, v in live.items() if k != "params"}
            values.update(
                {k: v for k, v in loaded.items() if k != "params" and (k in values or k not in shadow.defaults)}
            )
            groups.append({**values, "params": ids})
        # DistributedFusedAdam counts steps once for all parameters; torch's Adam per parameter.
        state["step"] = max(steps, default=0)
        return {"state": state, "param_groups": groups, "format": 2}

    def memory_footprint(self) -> dict[str, int]:
        assert self.module is not None and self.optimizer is not None
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        grads = sum(p.numel() * p.element_size() for p in self.module.parameters() if p.requires_grad)
        shard = 0
        # apex's StateBucket keeps this rank's shard of each bucket.
        for bucket in self.optimizer.state.get("buckets", []):
            for name in ("exp_avg_shard", "exp_avg_sq_shard", "params_shard", "param_remainders_shard"):
                tensor = getattr(bucket, name, None)
                if isinstance(tensor, torch.Tensor):
                    shard += tensor.numel() * tensor.element_size()
        return {"parameters": params, "gradients": grads, "optimizer_state": shard}

    def teardown(self) -> None:
        # DistributedFusedAdam's hooks live on the parameters' gradient
        # accumulators, kept alive by its _grad_accs list: release them, or the
        # module would keep sending its gradients to a dead optimizer.
        release_grad_accumulators(self.optimizer)
        self._recipe = None
        super().teardown()
