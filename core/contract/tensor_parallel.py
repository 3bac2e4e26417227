"""Tensor-parallel plans: where a model's plan comes from, and how its entries name submodules.

A plan is ``{submodule name or pattern: style}``, Hugging Face's shape: patterns use ``*`` for one
path segment (``"layers.*.mlp.up_proj"``), styles are Hugging Face's names, of which tensor
parallel on ``nn.Linear`` applies :data:`STYLES` (``"colwise"`` splits a layer by output features,
``"rowwise"`` by input features; Megatron's pairing puts a colwise layer before a rowwise one).

Where :func:`tensor_parallel_plan` finds it, in this order (the first that gives one wins, whole):

1. **The model's own plan**: ``model.tp_plan`` (a mapping, or a method returning one), else Hugging
   Face's ``base_model_tp_plan`` on the model or on its ``config``. A model that declares a plan
   declares all of it: plugins are not asked, so a model can always override what a plugin knows.
2. **Plans registered for known block types**: the ``unison_tensor_parallel_plan(module)`` hook,
   asked about each submodule, outermost first. A plugin that knows the module's type returns the
   block's plan in names relative to the block; :func:`compose_block_plans` prefixes each with the
   block's qualified name (a plan ``{"mlp.up": "colwise"}`` for the block at ``layers.0`` becomes
   ``{"layers.0.mlp.up": "colwise"}``). The descendants of a block a plugin answered for are not
   asked: the block's plan covers its inside, so two plugins never plan the same layer twice.

An empty result is no plan; a strategy that needs one refuses the model (the declared
``Feature.NO_TENSOR_PARALLEL_PLAN``). :func:`resolve_plan` expands patterns to submodule names and
rejects, before any process group, what tensor parallel on ``nn.Linear`` cannot run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from unison.errors import ConfigurationError, PluginError


class PlanHooks(Protocol):
    """What the contract asks of a run's plugins: the ``unison_tensor_parallel_plan`` hook.

    :class:`~unison.plugin.manager.PluginManager` is one (the plugin system sits above the contract,
    so the contract names only the part it calls).
    """

    def unison_tensor_parallel_plan(self, *, module: torch.nn.Module) -> dict[str, str] | None: ...


#: The plan styles tensor parallel applies, by Hugging Face's names (``ColwiseParallel`` and
#: ``RowwiseParallel`` in DTensor; ``"colwise_gather_output"``, Hugging Face's plan for a causal LM's
#: ``lm_head``, is ``ColwiseParallel`` whose output is gathered whole on every tp rank;
#: ``"embedding_rowwise"``, its plan for the token embedding, is ``RowwiseParallel`` of an
#: ``nn.Embedding``: vocabulary rows split, lookups summed). Other Hugging Face styles
#: (``"colwise_rep"``, ``"sequence_parallel"``, ``"local_*"``, ...) are refused by :func:`resolve_plan`,
#: naming them.
STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")

#: What a block-plan lookup is: a module -> its plan relative to it, or ``None`` (not a known block).
BlockPlans = Callable[[torch.nn.Module], "Mapping[str, str] | None"]


def tensor_parallel_plan(model: torch.nn.Module, plugins: PlanHooks | None = None) -> dict[str, str] | None:
    """The model's tensor-parallel plan, ``{submodule name or pattern: style}``, or ``None`` for none.

    The model's own plan first (:func:`model_plan`), else the plans ``plugins`` register for the
    model's blocks (:func:`compose_block_plans` over the ``unison_tensor_parallel_plan`` hook). With
    ``plugins=None`` only the model's own plan is read. Which styles a strategy applies is the
    strategy's to decide (:func:`resolve_plan` checks the ones in :data:`STYLES`).
    """
    plan = model_plan(model)
    if plan is None and plugins is not None:
        plan = compose_block_plans(model, lambda module: plugins.unison_tensor_parallel_plan(module=module))
    return plan


def model_plan(model: torch.nn.Module) -> dict[str, str] | None:
    """The plan the model declares itself (``tp_plan``, else Hugging Face's ``base_model_tp_plan``), or ``None``.

    ``tp_plan`` may be a mapping or a method returning one; ``base_model_tp_plan`` is read on the
    model, then on its ``config``. An empty plan is no plan.
    """
    plan = getattr(model, "tp_plan", None)
    if callable(plan):
        plan = plan()
    if not plan:
        plan = getattr(model, "base_model_tp_plan", None) or getattr(
            getattr(model, "config", None), "base_model_tp_plan", None
        )
    return {str(k): str(v) for k, v in plan.items()} if plan else None


def compose_block_plans(model: torch.nn.Module, block_plan: BlockPlans) -> dict[str, str] | None:
    """The whole-model plan made of the plans ``block_plan`` gives for the model's blocks, or ``None``.

    ``block_plan`` is asked about the model itself and each submodule in ``named_modules()`` order
    (outermost first), except the descendants of a module it answered for. Each answer's keys are
    prefixed with the module's qualified name (none for the model itself). An answer that is not a
    mapping is a :class:`~unison.errors.PluginError`; an empty one (a known block with nothing to
    split) stops the descent and adds nothing.
    """
    plan: dict[str, str] = {}
    answered: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in answered):
            continue
        block = block_plan(module)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise PluginError(
                f"unison_tensor_parallel_plan returned a {type(block).__name__} for the "
                f"{type(module).__name__} at {name or '(the model)'!r}; return {{submodule: style}} or None"
            )
        answered.append(f"{name}." if name else "")
        for key, style in block.items():
            plan[f"{name}.{key}" if name else str(key)] = str(style)
    return plan or None


def resolve_plan(model: torch.nn.Module, plan: Mapping[str, str], tp_size: int, *, who: str) -> dict[str, str]:
    """``plan`` with its patterns expanded to submodule names, each checked for tensor parallel over
    ``tp_size`` ranks; a :class:`~unison.errors.ConfigurationError` for what cannot run.

    Refused, naming the entry: a style outside :data:`STYLES`, an entry that matches no submodule, a
    planned module that is not an ``nn.Linear``, a split dimension ``tp_size`` does not divide.
    ``who`` (the strategy's name) is said in the messages.
    """
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for key, style in plan.items():
        if style not in STYLES:
            raise ConfigurationError(
                "model.tp_plan",
                f"tensor-parallel style {style!r} (for {key!r}) is not supported by {who}",
                f"use one of {', '.join(map(repr, STYLES))} (ColwiseParallel / RowwiseParallel)",
            )
        names = [n for n in modules if n and pattern(key).match(n)]
        if not names:
            raise ConfigurationError(
                "model.tp_plan", f"plan entry {key!r} matches no submodule", "name submodules of the model"
            )
        for name in names:
            module: Any = modules[name]
            kind = torch.nn.Embedding if style == "embedding_rowwise" else torch.nn.Linear
            if not isinstance(module, kind):
                raise ConfigurationError(
                    "model.tp_plan",
                    f"plan entry {key!r} names {name!r}, a {type(module).__name__}; {who} splits it as {style!r}, "
                    f"which takes an nn.{kind.__name__}",
                    "plan Linear layers colwise or rowwise, and Embedding layers embedding_rowwise",
                )
            if style == "embedding_rowwise":
                split = module.num_embeddings
            else:
                split = module.out_features if style.startswith("colwise") else module.in_features
            if split % tp_size:
                raise ConfigurationError(
                    "strategy_options.tp_size",
                    f"{name!r} ({style}) splits {split} features, not divisible by tp_size={tp_size}",
                    "pick a tp_size that divides every split dimension",
                )
            resolved[name] = style
    return resolved


def pattern(key: str) -> re.Pattern[str]:
    """The regular expression of a plan key: ``*`` matches one path segment, everything else itself."""
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


__all__ = [
    "STYLES",
    "BlockPlans",
    "compose_block_plans",
    "model_plan",
    "pattern",
    "resolve_plan",
    "tensor_parallel_plan",
]
