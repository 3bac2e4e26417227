"""Tensor-parallel plans: where a model's plan comes from, and how its entries name submodules.

A plan is ``{submodule name or pattern: style}``, Hugging Face's shape: patterns use ``*`` for one
path segment (``"layers.*.mlp.up_proj"``), styles are Hugging Face's names, of which tensor
parallel on ``nn.Linear`` applies :data:`STYLES` (``"colwise"`` splits a layer by output features,
``"rowwise"`` by input features; Megatron's pairing puts a colwise layer before a rowwise one).

:func:`tensor_parallel_plan` reads the model's own plan: ``model.tp_plan`` (a mapping, or a method
returning one), else Hugging Face's ``base_model_tp_plan`` on the model or on its ``config``. An
empty result is no plan; a strategy that needs one refuses the model (the declared
``Feature.NO_TENSOR_PARALLEL_PLAN``). :func:`resolve_plan` expands patterns to submodule names and
rejects, before any process group, what tensor parallel on ``nn.Linear`` cannot run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from unison.errors import ConfigurationError

#: The plan styles tensor parallel applies, by Hugging Face's names (``ColwiseParallel`` and
#: ``RowwiseParallel`` in DTensor). Other Hugging Face styles (``"colwise_rep"``,
#: ``"sequence_parallel"``, ``"local_*"``, ...) are refused by :func:`resolve_plan`, naming them.
STYLES = ("colwise", "rowwise")


def tensor_parallel_plan(model: torch.nn.Module) -> dict[str, str] | None:
    """The model's own tensor-parallel plan, ``{submodule name or pattern: style}``, or ``None``.

    Read from ``model.tp_plan`` (a mapping, or a method returning one), else Hugging Face's
    ``base_model_tp_plan`` on the model or on its ``config``. An empty plan is no plan. Which styles a
    strategy applies is the strategy's to decide (:func:`resolve_plan` checks the ones in :data:`STYLES`).
    """
    plan = getattr(model, "tp_plan", None)
    if callable(plan):
        plan = plan()
    if not plan:
        plan = getattr(model, "base_model_tp_plan", None) or getattr(
            getattr(model, "config", None), "base_model_tp_plan", None
        )
    return {str(k): str(v) for k, v in plan.items()} if plan else None


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
            if not isinstance(module, torch.nn.Linear):
                raise ConfigurationError(
                    "model.tp_plan",
                    f"plan entry {key!r} names {name!r}, a {type(module).__name__}; {who} splits nn.Linear only",
                    "plan Linear layers",
                )
            split = module.out_features if style == "colwise" else module.in_features
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


__all__ = ["STYLES", "pattern", "resolve_plan", "tensor_parallel_plan"]
