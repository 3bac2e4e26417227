"""``torch_zero``: DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO stage 1).

Parameters and gradients stay whole on every rank (DDP all-reduces them once
per optimizer step); only the optimizer *state* is partitioned: each rank keeps
the AdamW moments of the parameters it owns, updates those parameters, and
broadcasts them to the other ranks at the end of ``step()``.

Decisions, and why:

* **Building the optimizer.** The trainer hands strategies a factory
  ``params -> Optimizer``; ``ZeroRedundancyOptimizer`` instead wants an
  optimizer *class* plus keyword defaults, and builds the per-shard optimizer
  itself. We call the user's factory once on the parameters as a *probe* (it
  allocates no state: torch optimizers create state lazily at the first step),
  read its class, ``defaults`` and ``param_groups``, and build the ZeRO
  optimizer from the same class, defaults and groups (per-group options
  included). ``defaults`` are filtered to the keywords the class's constructor
  accepts (``AdamW.defaults`` carries ``decoupled_weight_decay``, which
  ``AdamW.__init__`` does not take), and the rebuilt optimizer's ``defaults``
  must equal the probe's, otherwise we refuse rather than train with a
  silently different optimizer. The alternative, an option naming the
  optimizer class, would make the user configure the optimizer twice.
* **Checkpoints** use the DCP format of ``ddp`` and ``single`` (keys are the
  module's parameter names, optimizer state keyed by name), so a checkpoint
  written here resumes under ``ddp``, ``single`` or ``torch_zero`` at any world
  size, and theirs resume here. Saving consolidates the sharded optimizer state
  on rank 0 (``consolidate_state_dict``), loads it into a transient plain
  optimizer of the same class, and lets
  ``torch.distributed.checkpoint.state_dict`` name it; loading reads the full
  state on every rank and hands it to ``ZeroRedundancyOptimizer.load_state_dict``,
  which keeps only this rank's shard. The price is a transient full copy of the
  optimizer state at save (rank 0) and load (every rank); the training-time
  footprint stays sharded.

:class:`OptimizerRecipe` and :func:`save_consolidated` / :func:`load_into_sharded`
are shared by the fairscale OSS strategies, which have the same shape.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from unison.errors import ConfigurationError
from unison.ownership import AccumulationOwner, GradAccumulation, Ownership, StateDictDeclaration, StateDictKind
from unison.plugin import hookimpl
from unison.registry import StrategySpec
from unison.strategy import DistEnv, OptimizerFactory

from unison.strategies._torch import TRAINER_PRECISION, ReplicatedStrategy

#: The checkpoint format shared with ``ddp`` and ``single``.
CONSOLIDATED_DCP_STATE = StateDictDeclaration(
    kind=StateDictKind.FULL,
    format=(
        "torch.distributed.checkpoint (DCP), keys = module parameter names, optimizer state keyed by name "
        "(the ddp/single format; the sharded optimizer state is consolidated on rank 0 to write it)"
    ),
    reshardable=True,
    canonical_export="module.state_dict() of the unwrapped module on every rank (parameters are replicated), fp32, CPU",
)


# --------------------------------------------------------------------------- #
# The user's optimizer, as a recipe a sharded optimizer can rebuild per shard
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class OptimizerRecipe:
    """What a sharding optimizer needs to rebuild the user's optimizer."""

    cls: type[torch.optim.Optimizer]
    #: Constructor keywords (``defaults`` filtered to what ``cls.__init__`` accepts).
    defaults: dict[str, Any]
    #: The probe's parameter groups (shallow copies: same Parameter objects, per-group options).
    param_groups: list[dict[str, Any]]

    @classmethod
    def from_factory(cls, make_optimizer: OptimizerFactory, params: Any, *, strategy: str) -> "OptimizerRecipe":
        probe = make_optimizer(params)
        if not isinstance(probe, torch.optim.Optimizer):
            raise ConfigurationError(
                "optimizer", f"the factory returned {type(probe).__name__}, not a torch.optim.Optimizer",
                "pass optimizer=lambda params: torch.optim.AdamW(params, ...)",
            )
        if probe.state:
            # A factory that steps or loads state would lose it: the probe is dropped.
            raise ConfigurationError(
                "optimizer", f"strategy {strategy!r} rebuilds the optimizer per shard, but the factory's optimizer already holds state",
                "return a freshly constructed optimizer from the factory",
            )
        signature = inspect.signature(type(probe).__init__)
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        defaults = {k: v for k, v in probe.defaults.items() if takes_any or k in signature.parameters}
        groups = [dict(g, params=list(g["params"])) for g in probe.param_groups]
        recipe = cls(type(probe), defaults, groups)
        rebuilt = recipe.build()
        if rebuilt.defaults != probe.defaults:
            raise ConfigurationError(
                "optimizer",
                f"strategy {strategy!r} cannot rebuild {type(probe).__name__} from its defaults "
                f"(rebuilt {rebuilt.defaults}, factory built {probe.defaults})",
                "use a torch.optim optimizer whose constructor takes its defaults as keywords, or another strategy",
            )
        return recipe

    def build(self, param_groups: list[dict[str, Any]] | None = None) -> torch.optim.Optimizer:
        """A plain (unsharded) optimizer of the user's class over ``param_groups``."""
        groups = param_groups if param_groups is not None else self.param_groups
        return self.cls([dict(g, params=list(g["params"])) for g in groups], **self.defaults)


# --------------------------------------------------------------------------- #
# Consolidated, name-keyed checkpoints for sharded optimizers
# --------------------------------------------------------------------------- #


def save_consolidated(
    module: torch.nn.Module,
    recipe: OptimizerRecipe,
    optimizer: torch.optim.Optimizer,
    consolidate: Callable[[], None],
    directory: Path,
) -> None:
    """Write the ddp/single DCP checkpoint from a sharded optimizer (collective).

    ``consolidate()`` must gather the full, index-keyed optimizer state on
    rank 0 so that ``optimizer.state_dict()`` returns it there. Rank 0 then
    loads it into a transient plain optimizer of the user's class, whose
    name-keyed state ``get_optimizer_state_dict`` produces in exactly the form
    ``ddp`` writes. The other ranks contribute the (replicated) model only; DCP
    writes each item once.
    """
    consolidate()
    state: dict[str, Any] = {"model": get_model_state_dict(module), "optim": {}}
    if torch.distributed.get_rank() == 0:
        full = optimizer.state_dict()
        shadow = recipe.build(optimizer.param_groups)
        shadow.load_state_dict(full)
        state["optim"] = get_optimizer_state_dict(module, shadow)
    dcp.save(state, checkpoint_id=str(directory))


def load_into_sharded(
    module: torch.nn.Module, recipe: OptimizerRecipe, optimizer: torch.optim.Optimizer, directory: Path
) -> None:
    """Load a ddp/single/torch_zero DCP checkpoint into a sharded optimizer (collective).

    Every rank reads the full, name-keyed state into a transient plain
    optimizer of the user's class, then hands its index-keyed ``state_dict()``
    to the sharded optimizer's ``load_state_dict``, which keeps this rank's
    shard only.
    """
    shadow = recipe.build(optimizer.param_groups)
    # The template names every tensor the checkpoint must provide (the model's
    # and, after torch initialises it, the optimizer's state per parameter).
    state = {"model": get_model_state_dict(module), "optim": get_optimizer_state_dict(module, shadow)}
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(module, state["model"])
    set_optimizer_state_dict(module, shadow, state["optim"])
    optimizer.load_state_dict(shadow.state_dict())


def sharded_state_bytes(local_optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state this rank holds (non-scalar tensors, as the base class counts)."""
    return sum(
        t.numel() * t.element_size()
        for s in local_optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


# --------------------------------------------------------------------------- #
# The strategy
# --------------------------------------------------------------------------- #


class TorchZeroStrategy(ReplicatedStrategy):
    """DDP for gradients, ``ZeroRedundancyOptimizer`` for a sharded optimizer state.

    Gradients are whole and equal on every rank after DDP's all-reduce, so the
    inherited clipping (local norm == global norm) and trainer-applied
    precisions (a plain GradScaler sees the same overflow on every rank) hold.
    """

    def __init__(self) -> None:
        super().__init__()
        self.recipe: OptimizerRecipe | None = None

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER,
                "DistributedDataParallel.no_sync() on non-boundary micro-steps; ZeroRedundancyOptimizer steps once "
                "per optimizer step (each rank updates its shard, then broadcasts it)",
            ),
            precision=TRAINER_PRECISION,
            state_dict=CONSOLIDATED_DCP_STATE,
            notes=(
                "optimizer built from the user's factory: its class, defaults and param groups are read from one "
                "probe instance and handed to ZeroRedundancyOptimizer(optimizer_class=..., **defaults)",
                "memory_footprint()['optimizer_state'] is this rank's shard only",
            ),
        )

    def setup(self, module: torch.nn.Module, make_optimizer: OptimizerFactory, *, precision: Any, env: DistEnv, settings: Any) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        module = module.to(env.device)
        self.module = module
        self.model = DistributedDataParallel(module, device_ids=[env.device.index] if env.device.type == "cuda" else None)
        self.recipe = OptimizerRecipe.from_factory(make_optimizer, module.parameters(), strategy=self.name)
        self.optimizer = ZeroRedundancyOptimizer(
            [dict(g) for g in self.recipe.param_groups], optimizer_class=self.recipe.cls, **self.recipe.defaults
        )

    def no_sync(self) -> ContextManager[Any]:
        return self.model.no_sync()

    def save_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None and self.recipe is not None
        zero = self.optimizer
        save_consolidated(self.module, self.recipe, zero, lambda: zero.consolidate_state_dict(to=0), directory)

    def load_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None and self.recipe is not None
        load_into_sharded(self.module, self.recipe, self.optimizer, directory)

    def memory_footprint(self) -> dict[str, int]:
        footprint = super().memory_footprint()
        # ZeroRedundancyOptimizer's own .state is empty: the shard lives in its
        # local optimizer.
        footprint["optimizer_state"] = sharded_state_bytes(self.optimizer.optim)  # type: ignore[union-attr]
        return footprint

    def teardown(self) -> None:
        super().teardown()
        self.recipe = None


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="torch_zero",
            factory=TorchZeroStrategy,
            description="DDP + torch ZeroRedundancyOptimizer (optimizer state sharded over ranks)",
        )
    ]
