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
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pydantic
import torch

from unison.contract.ownership import (
    AccumulationOwner,
    Feature,
    GradAccumulation,
    GradSync,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
    ReplicaInit,
    StateDictDeclaration,
    StateDictKind,
    WorldSizes,
)
from unison.contract.settings import TrainerSettings
from unison.contract.state import canonical
from unison.contract.strategy import OptimizerFactory, Strategy
from unison.errors import ConfigurationError
from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec
from unison.strategies._upstream.apex import release_grad_accumulators
from unison.strategies._upstream.torch import copy_step_hooks

#: The apex commit whose source this module was written against.
APEX_COMMIT = "6424da3b4faa6c8f062da4a48c424fff3f02d42d"
DISTRIBUTED_FUSED_ADAM_MODULE = "apex.contrib.optimizers.distributed_fused_adam"

NOT_INSTALLED = "NVIDIA apex is not installed (the PyPI package named apex is unrelated)"
CUDA_ONLY = "apex's DistributedFusedAdam is CUDA-only, and CUDA is not available here"
BUILD_HINT = (
    "build NVIDIA apex from https://github.com/NVIDIA/apex with its CUDA extensions "
    "(APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_DISTRIBUTED_ADAM=1 APEX_DEPRECATED_FUSED_ADAM=1 "
    "pip install -v --no-build-isolation . in a clone)"
)


def distributed_fused_adam_unavailable() -> str | None:
    """Why ``DistributedFusedAdam`` cannot run here, or ``None``.

    apex is looked up with ``find_spec`` first, and nothing of it is imported
    unless CUDA is available (its extensions need it), so listing strategies on
    a machine without apex or CUDA imports nothing.
    """
    try:
        installed = importlib.util.find_spec("apex") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return NOT_INSTALLED
    if not torch.cuda.is_available():
        return CUDA_ONLY
    try:
        importlib.import_module(DISTRIBUTED_FUSED_ADAM_MODULE)
    except Exception as exc:  # a partial build raises ImportError for its missing extension modules, or worse
        return (
            f"{DISTRIBUTED_FUSED_ADAM_MODULE} fails to import ({type(exc).__name__}: {exc}); the installed apex lacks "
            f"its distributed Adam extension: {BUILD_HINT}"
        )
    return None


# --------------------------------------------------------------------------- #
# Options and declaration
# --------------------------------------------------------------------------- #


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


_PRECISION = {
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

_STATE = StateDictDeclaration(
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


# --------------------------------------------------------------------------- #
# The user's optimizer as DistributedFusedAdam takes it
# --------------------------------------------------------------------------- #


def _fused_adam_class() -> type | None:
    """``apex.optimizers.FusedAdam`` if the user's code imported it (never imported here)."""
    module = sys.modules.get("apex.optimizers")
    return getattr(module, "FusedAdam", None) if module is not None else None


def _scalar(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _adam_options(values: dict[str, Any], bias_correction: bool) -> dict[str, Any]:
    beta1, beta2 = values["betas"]
    return {
        "lr": _scalar(values["lr"]),
        "betas": (_scalar(beta1), _scalar(beta2)),
        "eps": _scalar(values["eps"]),
        "weight_decay": _scalar(values["weight_decay"]),
        "bias_correction": bias_correction,
    }


def adam_hyperparameters(
    optimizer: torch.optim.Optimizer, *, strategy: str
) -> tuple[bool, dict[str, Any], list[dict[str, Any]]]:
    """``(adam_w_mode, defaults, per-group options)`` of the user's optimizer for ``DistributedFusedAdam``.

    ``defaults`` and each group's options are ``lr``, ``betas``, ``eps``,
    ``weight_decay`` and ``bias_correction``: ``DistributedFusedAdam``'s
    constructor keywords and parameter-group keys.

    Raises :class:`ConfigurationError` for an optimizer that is not Adam or
    AdamW, or an Adam option ``DistributedFusedAdam`` does not have.
    """
    fused = _fused_adam_class()
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    fix = (
        "return torch.optim.AdamW, torch.optim.Adam or apex.optimizers.FusedAdam from the optimizer factory (their "
        "lr, betas, eps, weight_decay and parameter groups are used), or pick another strategy"
    )
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam subclass
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        modes = {bool(g.get("decoupled_weight_decay", decoupled)) for g in optimizer.param_groups}
        for i, group in enumerate(optimizer.param_groups):
            for option, why in (
                ("amsgrad", "DistributedFusedAdam has no AMSGrad variant"),
                ("maximize", "DistributedFusedAdam only minimises"),
            ):
                if group.get(option):
                    raise ConfigurationError(
                        "optimizer",
                        f"strategy {strategy!r}: parameter group {i} of {name} sets {option}=True, but {why}",
                        f"drop {option}=True, or pick another strategy",
                    )
        if len(modes) > 1:
            raise ConfigurationError(
                "optimizer",
                f"strategy {strategy!r}: {name}'s parameter groups mix decoupled and L2 weight decay, but "
                "DistributedFusedAdam has one adam_w_mode for all groups",
                "use one weight-decay mode for every group",
            )
        adam_w_mode = modes.pop()
        # torch's Adam always corrects the bias.
        default_bias_correction, bias_corrections = True, [True] * len(optimizer.param_groups)
    elif fused is not None and isinstance(optimizer, fused):
        adam_w_mode = bool(optimizer.adam_w_mode)
        default_bias_correction = bool(optimizer.defaults["bias_correction"])
        bias_corrections = [bool(g["bias_correction"]) for g in optimizer.param_groups]
    else:
        raise ConfigurationError(
            "optimizer",
            f"strategy {strategy!r} trains with NVIDIA apex's DistributedFusedAdam, an Adam optimizer; the optimizer "
            f"factory returned {name}",
            fix,
        )
    groups = [_adam_options(g, b) for g, b in zip(optimizer.param_groups, bias_corrections)]
    return adam_w_mode, _adam_options(optimizer.defaults, default_bias_correction), groups


def _shadow_class(adam_w_mode: bool) -> type[torch.optim.Optimizer]:
    """The torch optimizer whose state layout the checkpoints use."""
    return torch.optim.AdamW if adam_w_mode else torch.optim.Adam


# --------------------------------------------------------------------------- #
# The strategy
# --------------------------------------------------------------------------- #


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
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER,
                "DistributedFusedAdam.no_sync() on non-boundary micro-steps (gradients add up in param.grad); on the "
                "last, the optimizer's post-backward hooks reduce-scatter each bucket as it fills, and grad_sync() "
                "finishes the rest before the norm",
                sync=GradSync.BOUNDARY,
            ),
            precision=_PRECISION,
            state_dict=_STATE,
            replica_init=ReplicaInit.TRAINER,
            world_sizes=world_sizes,
            # Checked by validate_optimizer, before any process group.
            refuses={
                Feature.ANY_OPTIMIZER: "it trains with DistributedFusedAdam, an Adam optimizer: the factory must "
                "return torch.optim.AdamW, torch.optim.Adam or apex.optimizers.FusedAdam",
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
        return self.optimizer.no_sync()  # type: ignore[attr-defined]  # DistributedFusedAdam's own

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
        return _shadow_class(self._adam_w_mode)(groups)

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
                    steps.append(int(_scalar(saved["step"])))
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
