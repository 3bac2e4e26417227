"""The user's optimizer as DistributedFusedAdam takes it: Adam hyper-parameters, checked and translated."""

from __future__ import annotations

import sys
from typing import Any

import torch

from unison.errors import ConfigurationError


def _fused_adam_class() -> Any:
    """``apex.optimizers.FusedAdam`` if the user's code imported it (never imported here)."""
    module = sys.modules.get("apex.optimizers")
    return getattr(module, "FusedAdam", None) if module is not None else None


def scalar(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _adam_options(values: dict[str, Any], bias_correction: bool) -> dict[str, Any]:
    beta1, beta2 = values["betas"]
    return {
        "lr": scalar(values["lr"]),
        "betas": (scalar(beta1), scalar(beta2)),
        "eps": scalar(values["eps"]),
        "weight_decay": scalar(values["weight_decay"]),
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


def shadow_class(adam_w_mode: bool) -> type[torch.optim.Optimizer]:
    """The torch optimizer whose state layout the checkpoints use."""
    return torch.optim.AdamW if adam_w_mode else torch.optim.Adam
