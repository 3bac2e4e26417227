"""What ``fsdp`` and ``fsdp1`` share: options, sharding units, precision tables, the sharded scaler, the base."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pydantic
import torch

from unison.contract.ownership import (
    PrecisionOwner,
    PrecisionSupport,
)
from unison.contract.state import dcp_load, dcp_save
from unison.contract.strategy import Strategy
from unison.errors import ConfigurationError


class FSDPOptions(pydantic.BaseModel):
    """Options of ``fsdp`` and ``fsdp1``."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3); ``False`` keeps them until backward
    (ZeRO-2-like, more memory, fewer all-gathers)."""
    shard_module_classes: list[str] | None = None
    """Class names of submodules sharded as their own unit; default: every submodule that directly
    owns parameters not shared outside it. The root is always sharded."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (the optimizer steps on
    the CPU); on a CPU device they already are, and the option changes nothing observable."""


# --------------------------------------------------------------------------- #
# Shared pieces
# --------------------------------------------------------------------------- #


#: Module types whose forward reads their children's parameters directly (see :func:`shard_units`).
_READS_CHILD_PARAMETERS: tuple[type[torch.nn.Module], ...] = (torch.nn.MultiheadAttention,)


def shard_units(model: torch.nn.Module, classes: list[str] | None) -> list[tuple[str, torch.nn.Module]]:
    """The submodules to shard individually, in ``named_modules`` (pre-)order.

    Default (``classes`` unset): every submodule that directly owns parameters
    not shared outside it, except the children of an ``nn.MultiheadAttention``
    (its forward reads ``out_proj.weight`` without calling ``out_proj``, so the
    projection is sharded with the attention module).

    Raises :class:`ConfigurationError` when an explicitly named class matches
    nothing or a matched module shares parameters with the rest of the model.
    """
    # How many module paths reach each parameter: a parameter reached from
    # outside a candidate module is shared (tied) and must stay with the root.
    reach = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    units: list[tuple[str, torch.nn.Module]] = []
    matched: set[str] = set()
    # Modules whose forward reads a child's parameters without calling the child
    # (nn.MultiheadAttention reads out_proj.weight directly): in the default
    # selection their children stay in the parent's unit, or the parent would
    # meet a still-sharded parameter.
    whole: list[str] = []
    for name, module in model.named_modules():
        if module is model:
            continue
        if classes is None:
            if any(name.startswith(prefix + ".") for prefix in whole):
                continue
            if isinstance(module, _READS_CHILD_PARAMETERS):
                whole.append(name)
            if next(module.parameters(recurse=False), None) is None:
                continue
        elif type(module).__name__ not in classes:
            continue
        else:
            matched.add(type(module).__name__)
        inner = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
        if not inner:
            continue
        if any(reach[pid] != n for pid, n in inner.items()):
            if classes is not None:
                raise ConfigurationError(
                    "strategy_options.shard_module_classes",
                    f"submodule {name!r} ({type(module).__name__}) shares a parameter with another part of the "
                    "model (tied weights); FSDP needs a shared parameter in exactly one sharding unit",
                    f"drop {type(module).__name__!r} from shard_module_classes (its parameters then stay with "
                    "the root) or name a class that contains every user of the shared parameter",
                )
            continue  # default selection: leave shared parameters to the root
        units.append((name, module))
    if classes is not None:
        missing = sorted(set(classes) - matched)
        if missing:
            present = sorted({type(m).__name__ for m in model.modules() if m is not model})
            raise ConfigurationError(
                "strategy_options.shard_module_classes",
                f"no submodule of the model has class {', '.join(map(repr, missing))}",
                f"name classes that occur in the model: {', '.join(present) or '(none)'}; or leave it unset",
            )
    return units


def sharding_policies(policy_precision: bool) -> tuple[Any, Any]:
    """FSDP2 ``MixedPrecisionPolicy`` for the inner units and for the root.

    With the sharding policy owning precision (bf16-mixed): parameters gathered in bf16, gradients
    reduced in fp32, and the root's outputs cast to fp32 so the loss runs in fp32; otherwise the
    defaults (no casting).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not policy_precision:
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()
    inner = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    return inner, root


def _float_outputs(data: Any) -> Any:
    """Low-precision floating outputs cast to fp32 (the loss then runs in fp32)."""
    if isinstance(data, torch.Tensor):
        return data.float() if data.is_floating_point() and data.dtype != torch.float32 else data
    if isinstance(data, (list, tuple)):
        return type(data)(_float_outputs(d) for d in data)
    if isinstance(data, dict):
        return {k: _float_outputs(v) for k, v in data.items()}
    return data


def _sharded_grad_scaler(device: torch.device) -> torch.amp.GradScaler:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class _Scaler(ShardedGradScaler):
        """``ShardedGradScaler`` whose unscale is quiet about DTensor gradients.

        With FSDP2 the gradients are DTensors: the fused unscale kernel runs on
        each rank's local shard and writes the found-inf flag, which
        ``unscale_`` then all-reduces over the world, so every rank backs the
        scale off together (checked on CPU/gloo with an overflowing sample on
        one rank: both ranks skip the step and end at the same scale). DTensor warns
        that it wraps the one-element flag as a replicated tensor; that is
        exactly the intended meaning, so the warning is silenced here only.
        """

        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
                super().unscale_(optimizer)

    return _Scaler(device.type)


def precision_table(policy: str) -> dict[str, PrecisionSupport]:
    return {
        "32-true": PrecisionSupport(PrecisionOwner.TRAINER, "fp32 sharded parameters, fp32 compute and reduce-scatter"),
        "bf16-mixed": PrecisionSupport(PrecisionOwner.SHARDING_POLICY, policy),
        "bf16-true": PrecisionSupport(
            PrecisionOwner.TRAINER,
            "module.to(bfloat16) by the trainer before sharding: bf16 shards, bf16 gradient reduce-scatter, "
            "bf16 optimizer state",
        ),
        "16-mixed": PrecisionSupport(
            PrecisionOwner.TRAINER,
            "torch.autocast(float16) by the trainer over fp32 shards + ShardedGradScaler from make_grad_scaler "
            "(per-shard inf check, flag all-reduced: every rank skips the same steps)",
        ),
    }


SHARDED_DCP = (
    "torch.distributed.checkpoint (DCP), one shard file per rank; keys = module parameter names, "
    "optimizer state keyed by name"
)


class ShardedStrategy(Strategy):
    """What ``fsdp`` and ``fsdp1`` share: options, validation, scaler, footprint."""

    #: The options model this strategy's options are validated against.
    options_model: type[FSDPOptions] = FSDPOptions

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = self.options_model(**options)
        self._policy_precision = False

    def validate_model(self, model: torch.nn.Module, settings: Any) -> None:
        if next(model.parameters(), None) is None:
            raise ConfigurationError(
                "model", f"strategy {self.name!r} has no parameters to shard", "pass a model with parameters"
            )
        shard_units(model, self.options.shard_module_classes)  # raises on a bad selection

    def make_grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        return _sharded_grad_scaler(device)

    def forward(self, inputs: Any) -> Any:
        out = self.model(inputs)
        # The policy computes in bf16; hand the loss fp32 outputs (see module docstring).
        return _float_outputs(out) if self._policy_precision else out

    def _checkpoint_root(self) -> torch.nn.Module:
        """The module the DCP state-dict API is called on (the FSDP root)."""
        return self.model

    def save_state(self, directory: Path) -> None:
        assert self.model is not None and self.optimizer is not None
        dcp_save(self._checkpoint_root(), self.optimizer, directory)

    def load_state(self, directory: Path) -> None:
        assert self.model is not None and self.optimizer is not None
        dcp_load(self._checkpoint_root(), self.optimizer, directory)
