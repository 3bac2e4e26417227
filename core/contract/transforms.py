"""The module features a run may ask for: activation checkpointing and ``torch.compile``.

Plain functions, applied by a strategy to the module it trains before wrapping
it (torchtitan's order: activation checkpointing, then compile, then the
data-parallel wrapper). The default :meth:`Strategy.apply_features
<unison.contract.strategy.Strategy.apply_features>` checkpoints the blocks and
compiles the whole forward; ``fsdp`` compiles each block before sharding it.

Both replace a module's ``forward`` on the instance instead of wrapping the
module, so that no parameter is renamed: the module's names are its state's
names (the canonical state dict, DCP checkpoints, a pipeline's split points).
``CheckpointWrapper`` would insert ``_checkpoint_wrapped_module.`` and
``torch.compile(module)`` ``_orig_mod.`` into every name below it. And
``Module.compile()``, which keeps the names, compiles nothing for torch's own
modules (measured, torch 2.13: an ``nn.Sequential`` or ``nn.Linear`` after
``.compile()`` runs zero dynamo frames), while a compiled ``forward`` does.

Which modules are *blocks* (:func:`model_blocks`): the children of the
model's ``blocks`` attribute when it is an ``nn.ModuleList`` or
``nn.Sequential`` (a transformer's layers); otherwise the split points a
pipeline uses (the children named by ``pipeline_layers``, or an
``nn.Sequential``'s children). Children without parameters (activations) are
not blocks: recomputing them alone saves nothing worth a recompute.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from unison.contract.settings import checkpoint_every
from unison.errors import ConfigurationError

__all__ = ["checkpoint_blocks", "compile_forward", "compile_options", "model_blocks"]


def model_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's blocks in forward order, as ``(name, module)`` (see the module docstring); may be empty."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential)):
        children = [(f"blocks.{name}", child) for name, child in blocks.named_children()]
    elif getattr(model, "pipeline_layers", None) is not None:
        children = [(name, model.get_submodule(name)) for name in model.pipeline_layers]
    elif isinstance(model, torch.nn.Sequential):
        children = list(model.named_children())
    else:
        children = []
    return [(name, child) for name, child in children if next(child.parameters(), None) is not None]


def required_blocks(model: torch.nn.Module, option: str) -> list[tuple[str, torch.nn.Module]]:
    """:func:`model_blocks`, refused with a :class:`ConfigurationError` naming ``option`` when there are none."""
    blocks = model_blocks(model)
    if not blocks:
        raise ConfigurationError(
            option,
            f"{type(model).__name__} has no blocks: it is not an nn.Sequential and has neither a `blocks` "
            "ModuleList nor pipeline_layers",
            "keep the model's repeated layers in `self.blocks = nn.ModuleList(...)`, or declare "
            f"pipeline_layers = [child names in forward order]; or unset {option}",
        )
    return blocks


def checkpoint_blocks(model: torch.nn.Module, policy: str) -> list[str]:
    """Recompute every ``policy``-selected block's forward in backward; return the names of those blocks.

    ``"full"``: every block; ``"selective:N"``: every N-th (blocks N-1, 2N-1, ...,
    counted from 0, as torchtitan's ``selective_ac_option``). Non-reentrant
    ``torch.utils.checkpoint`` (``use_reentrant=False``: works with
    ``torch.compile``, keyword arguments and parameters that need no grad),
    with the RNG state preserved, so the recomputed forward is the one that ran
    and training is bit-for-bit the same as without.
    """
    every = checkpoint_every(policy)
    chosen = [
        (n, b) for i, (n, b) in enumerate(required_blocks(model, "activation_checkpointing")) if (i + 1) % every == 0
    ]
    for _, block in chosen:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return [name for name, _ in chosen]


def compile_options(setting: bool | dict[str, Any]) -> dict[str, Any] | None:
    """``torch.compile``'s keyword arguments for the ``compile`` setting (``None``: do not compile).

    Unknown keys are refused here, before any process group, rather than by
    ``torch.compile`` on every rank at setup.
    """
    if setting is False:
        return None
    options = {} if setting is True else dict(setting)
    known = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigurationError(
            "compile",
            f"{unknown} {'is' if len(unknown) == 1 else 'are'} not torch.compile keyword arguments",
            f"use True, or a table of {sorted(known)}",
        )
    return options


def compile_forward(module: torch.nn.Module, options: dict[str, Any]) -> None:
    """Replace ``module.forward`` with ``torch.compile(module.forward, **options)`` (names unchanged).

    Hooks registered on ``module`` itself (a wrapper's, FSDP2's) run around
    the compiled forward, outside the graph; hooks on its submodules are traced.
    """
    module.forward = torch.compile(module.forward, **options)
