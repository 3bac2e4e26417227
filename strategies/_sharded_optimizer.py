"""Optimizer-state sharding shared by ``torch_zero`` (:mod:`unison.strategies.torch_zero`) and the fairscale
OSS strategies: DDP plus a sharding optimizer, here ``torch.distributed.optim.ZeroRedundancyOptimizer``
(ZeRO stage 1) or fairscale's OSS.

Parameters and gradients stay whole on every rank (DDP all-reduces them once
per optimizer step); only the optimizer *state* is partitioned: each rank keeps
the AdamW moments of the parameters it owns, updates those parameters, and
broadcasts them to the other ranks at the end of ``step()``.

Decisions, and why:

* **Building the optimizer.** The trainer hands strategies a factory
  ``params -> Optimizer``; ``ZeroRedundancyOptimizer`` (and fairscale's OSS)
  instead want an optimizer *class* plus keyword defaults, and build the
  per-shard ("local") optimizer themselves. We call the user's factory once on
  all parameters (torch optimizers allocate state lazily, so this costs
  nothing; Adagrad, which makes its state in its constructor, is accepted when
  that state is exactly what a fresh instance makes), read its class, ``defaults`` and ``param_groups`` (per-group
  options included), and give the sharding optimizer the same class, defaults
  and groups. Its local optimizer is then the user's *own instance*, re-pointed
  at this rank's share of each group (:meth:`OptimizerRecipe.shard_constructor`):
  step hooks the user registered on it fire, and counting its ``step()`` calls
  counts real updates, as under ``ddp``. ``defaults`` are filtered to the
  keywords the class's constructor accepts (``AdamW.defaults`` carries
  ``decoupled_weight_decay``, which ``AdamW.__init__`` does not take), and an
  instance rebuilt from class and defaults must have the user's ``defaults``,
  otherwise we refuse: checkpoints go through such rebuilt instances. The
  alternative, an option naming the optimizer class, would make the user
  configure the optimizer twice.
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

:class:`OptimizerSharding` is the component a strategy holds to shard its
optimizer (:class:`ShardedOptimizerStrategy` for ``torch_zero`` and
``fairscale_oss``, which differ only in the component; ``fairscale_sdp``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from unison.contract.ownership import (
    AccumulationOwner,
    GradAccumulation,
    LossNormalisation,
    Ownership,
    StateDictDeclaration,
    StateDictKind,
)
from unison.contract.replicated import TRAINER_PRECISION, ReplicatedStrategy
from unison.contract.strategy import OptimizerFactory, Strategy
from unison.errors import ConfigurationError
from unison.strategies.ddp import distributed_data_parallel

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
    """The user's optimizer, as a sharding optimizer needs it."""

    cls: type[torch.optim.Optimizer]
    #: Constructor keywords (``defaults`` filtered to what ``cls.__init__`` accepts).
    defaults: dict[str, Any]
    #: The factory's parameter groups (shallow copies: same Parameter objects, per-group options).
    param_groups: list[dict[str, Any]]
    #: The instance the user's factory returned (becomes this rank's local optimizer).
    user_optimizer: torch.optim.Optimizer = field(compare=False, repr=False)

    @classmethod
    def from_factory(cls, make_optimizer: OptimizerFactory, params: Any, *, strategy: str) -> OptimizerRecipe:
        probe = make_optimizer(params)
        if not isinstance(probe, torch.optim.Optimizer):
            raise ConfigurationError(
                "optimizer",
                f"the factory returned {type(probe).__name__}, not a torch.optim.Optimizer",
                "pass optimizer=lambda params: torch.optim.AdamW(params, ...)",
            )
        signature = inspect.signature(type(probe).__init__)
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        defaults = {k: v for k, v in probe.defaults.items() if takes_any or k in signature.parameters}
        groups = [dict(g, params=list(g["params"])) for g in probe.param_groups]
        recipe = cls(type(probe), defaults, groups, probe)
        rebuilt = recipe.build()
        # State the constructor made (Adagrad's sum and step) is what a fresh instance over the shard
        # makes too, and shard_constructor drops it for parameters the shard does not own; any other
        # state would be carried into a shard that cannot own it.
        if probe.state and not _same_state(probe.state, rebuilt.state):
            raise ConfigurationError(
                "optimizer",
                f"strategy {strategy!r} shards the optimizer, but the factory's optimizer already holds state",
                "return a freshly constructed optimizer from the factory",
            )
        if rebuilt.defaults != probe.defaults:
            raise ConfigurationError(
                "optimizer",
                f"strategy {strategy!r} cannot rebuild {type(probe).__name__} from its defaults "
                f"(rebuilt {rebuilt.defaults}, factory built {probe.defaults})",
                "use a torch.optim optimizer whose constructor takes its defaults as keywords, or another strategy",
            )
        return recipe

    def build(self, param_groups: list[dict[str, Any]] | None = None) -> torch.optim.Optimizer:
        """A fresh, plain (unsharded) optimizer of the user's class over ``param_groups``."""
        groups = param_groups if param_groups is not None else self.param_groups
        return self.cls([dict(g, params=list(g["params"])) for g in groups], **self.defaults)

    def shard_constructor(self) -> Callable[..., torch.optim.Optimizer]:
        """The ``optimizer_class`` to give ZeroRedundancyOptimizer / OSS.

        Both call it once, with this rank's parameter groups and the defaults,
        to build their local optimizer. The first call returns the user's own
        instance holding exactly those groups; a later call (a sharding
        optimizer rebuilding its partition) gets a fresh instance of the class.
        """
        adopted = False

        def construct(param_groups: Any, **defaults: Any) -> torch.optim.Optimizer:
            nonlocal adopted
            if adopted:
                return self.cls(param_groups, **defaults)
            adopted = True
            optimizer = self.user_optimizer
            optimizer.param_groups = []
            for group in param_groups:
                optimizer.add_param_group(group)
            # Constructor-made state (see from_factory) of parameters another rank owns.
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for param in [p for p in optimizer.state if id(p) not in owned]:
                del optimizer.state[param]
            return optimizer

        return construct


def _same_state(a: Any, b: Any) -> bool:
    """Whether two optimizers' ``state`` mappings hold equal values for the same parameters."""
    if {id(p) for p in a} != {id(p) for p in b}:
        return False
    other = {id(p): s for p, s in b.items()}
    for param, state in a.items():
        theirs = other[id(param)]
        if state.keys() != theirs.keys():
            return False
        for key, value in state.items():
            if torch.is_tensor(value) != torch.is_tensor(theirs[key]):
                return False
            if not (torch.equal(value, theirs[key]) if torch.is_tensor(value) else value == theirs[key]):
                return False
    return True


# --------------------------------------------------------------------------- #
# Consolidated, name-keyed checkpoints for sharded optimizers
# --------------------------------------------------------------------------- #


def _zero_redundancy_optimizer() -> type[torch.optim.Optimizer]:
    """``torch.distributed.optim.ZeroRedundancyOptimizer``, imported on first use (a quarter second).

    The first import must happen before any process group exists: the module binds
    ``group=dist.group.WORLD`` as a default argument when it is first imported, so an
    import after init_process_group pins that group for the life of the process and its
    gloo threads outlive destroy_process_group (see
    unison.launch.lifecycle.drain_collective_threads for what that costs at exit).
    :func:`zero_redundancy_sharding` therefore imports it when the strategy is constructed, which the
    trainer does before it starts the process group.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer


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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

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
# The component and the strategy
# --------------------------------------------------------------------------- #


class OptimizerSharding:
    """Optimizer-state sharding as a part a strategy holds (composition, not a base class).

    ``make`` builds the sharding optimizer (ZeroRedundancyOptimizer, fairscale
    OSS) from the user's :class:`OptimizerRecipe`; ``consolidate`` gathers its
    full state on rank 0 (collective). A strategy delegates building, saving,
    loading and the memory count to it (:class:`HoldsOptimizerSharding` writes the
    delegation once), so ``torch_zero``, ``fairscale_oss`` and ``fairscale_sdp``
    share it with different wrappers (DDP, fairscale's ShardedDataParallel).
    """

    def __init__(
        self,
        make: Callable[[OptimizerRecipe], torch.optim.Optimizer],
        consolidate: Callable[[Any], None],
        description: str,
        notes: tuple[str, ...],
    ) -> None:
        self._make, self._consolidate = make, consolidate
        #: How the sharding optimizer steps (the ownership's accumulation text ends with it).
        self.description = description
        #: The ownership notes of a strategy holding this component.
        self.notes = notes
        self.recipe: OptimizerRecipe | None = None
        self.optimizer: Any = None

    def build(self, make_optimizer: OptimizerFactory, module: torch.nn.Module, *, strategy: str) -> Any:
        """The sharding optimizer over the factory's class, defaults and groups (kept for save and load)."""
        self.recipe = OptimizerRecipe.from_factory(make_optimizer, module.parameters(), strategy=strategy)
        self.optimizer = self._make(self.recipe)
        return self.optimizer

    def save(self, module: torch.nn.Module, directory: Path) -> None:
        assert self.recipe is not None
        save_consolidated(module, self.recipe, self.optimizer, lambda: self._consolidate(self.optimizer), directory)

    def load(self, module: torch.nn.Module, directory: Path) -> None:
        assert self.recipe is not None
        load_into_sharded(module, self.recipe, self.optimizer, directory)

    def state_bytes(self) -> int:
        """This rank's shard: the sharding optimizer's own ``.state`` is empty, the shard lives in its local
        optimizer (``.optim`` for both ZeroRedundancyOptimizer and OSS)."""
        return sharded_state_bytes(self.optimizer.optim)

    def reset(self) -> None:
        self.recipe = self.optimizer = None


def zero_redundancy_sharding() -> OptimizerSharding:
    """``torch.distributed.optim.ZeroRedundancyOptimizer`` as the component (imported now: see
    :func:`_zero_redundancy_optimizer` why before any process group)."""
    cls = _zero_redundancy_optimizer()
    return OptimizerSharding(
        lambda recipe: cls(
            [dict(g) for g in recipe.param_groups], optimizer_class=recipe.shard_constructor(), **recipe.defaults
        ),
        lambda optimizer: optimizer.consolidate_state_dict(to=0),
        "ZeroRedundancyOptimizer steps once per optimizer step (each rank updates its shard, then broadcasts it)",
        (
            "optimizer: the factory's class, defaults and param groups go to ZeroRedundancyOptimizer, whose local "
            "optimizer is the factory's own instance re-pointed at this rank's shard",
            "memory_footprint()['optimizer_state'] is this rank's shard only",
        ),
    )


class HoldsOptimizerSharding(Strategy):
    """A strategy that holds an :class:`OptimizerSharding` as ``self.sharding``: the delegation, written once.

    It builds the optimizer, saves and loads it, counts its memory and forgets it at teardown through
    the component; put it first among the bases (``class S(HoldsOptimizerSharding, ReplicatedStrategy)``)
    and set ``self.sharding`` in ``__init__``. ``torch_zero`` and ``fairscale_oss``
    (:class:`ShardedOptimizerStrategy`) and ``fairscale_sdp`` use it.
    """

    sharding: OptimizerSharding

    def build_optimizer(self, make_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        assert self.module is not None
        return self.sharding.build(make_optimizer, self.module, strategy=self.name)

    def save_state(self, directory: Path) -> None:
        assert self.module is not None
        self.sharding.save(self.module, directory)

    def load_state(self, directory: Path) -> None:
        assert self.module is not None
        self.sharding.load(self.module, directory)

    def memory_footprint(self) -> dict[str, int]:
        return {**super().memory_footprint(), "optimizer_state": self.sharding.state_bytes()}

    def teardown(self) -> None:
        super().teardown()
        self.sharding.reset()


class ShardedOptimizerStrategy(HoldsOptimizerSharding, ReplicatedStrategy):
    """DDP for gradients, an :class:`OptimizerSharding` for a sharded optimizer state.

    Gradients are whole and equal on every rank after DDP's all-reduce, so the
    inherited clipping (local norm == global norm) and trainer-applied
    precisions (a plain GradScaler sees the same overflow on every rank) hold.
    ``torch_zero`` holds ZeroRedundancyOptimizer, ``fairscale_oss`` fairscale's OSS.
    """

    def __init__(self, sharding: OptimizerSharding) -> None:
        super().__init__()
        self.sharding = sharding

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            loss_normalisation=LossNormalisation(
                over=("the data-parallel replicas: DistributedDataParallel's all-reduce averages")
            ),
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER,
                f"DistributedDataParallel.no_sync() on non-boundary micro-steps; {self.sharding.description}",
            ),
            precision=TRAINER_PRECISION,
            state_dict=CONSOLIDATED_DCP_STATE,
            notes=self.sharding.notes,
        )

    def wrap_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        assert self.env is not None
        return distributed_data_parallel(module, self.env)

    def no_sync(self) -> AbstractContextManager[Any]:
        return self.model.no_sync()
