"""The strategy contract: everything a backend plugin implements, top to bottom.

A strategy plugin is a module (published under the ``unison`` entry-point
group) with a ``unison_strategies`` hook returning :class:`StrategySpec`
values, and a :class:`Strategy` subclass. Read this module in order:

1. **Declare** (no process group, no device): :attr:`Strategy.ownership`
   returns a frozen :class:`Ownership`: who owns gradient accumulation
   (:class:`AccumulationOwner`), how each precision is applied
   (:class:`PrecisionSupport`), the state_dict format
   (:class:`StateDictDeclaration`), who makes replicas equal at start
   (:class:`ReplicaInit`), the :class:`Feature` values and world sizes it
   refuses. ``unison describe NAME`` prints it; the trainer enforces it.
2. **Implement the interface of the declared accumulation owner** — one of the
   three small interfaces below. ``build_strategy`` refuses a strategy whose
   declared owner's interface is missing, before any process group:

   ============================  ==========================================  =========================
   declared owner                what the trainer does per optimizer step      interface to implement
   ============================  ==========================================  =========================
   ``trainer``, sync boundary    micro-steps but the last inside               :class:`DeferredGradSync`
                                 ``no_sync()``; ``backward(loss / A)``         (``no_sync``)
   ``trainer``, every micro-step ``backward(loss / A)`` for each micro-batch   nothing more
   ``engine``                    ``backward(loss)``; checks                    :class:`EngineAccumulation`
                                 ``is_accumulation_boundary()`` each time      (``is_accumulation_boundary``)
   ``schedule``                  ``forward_backward(micro_batches, ...)``      :class:`ScheduleAccumulation`
   ============================  ==========================================  =========================

   then, for every owner: ``scale_gradients`` (only for ``(loss_sum, num_items)``
   losses, by the factor the declared :class:`LossNormalisation` gives) ->
   ``clip_grad_norm`` (global norm) -> ``optimizer_step`` -> ``zero_grad``.
3. **Set up** (:meth:`Strategy.setup`, a template method): called once per
   ``fit`` on every rank, after the process group exists, the seed was set and
   replicas were made equal (when the trainer owns that). It binds the env and
   runs the hooks a strategy overrides as needed: ``configure_module`` (move
   to the device), ``apply_features`` (activation checkpointing, ``torch.compile``;
   API 2.1), then ``build`` (API 2.3), which by default is ``wrap_module`` (DDP,
   FSDP...) then ``build_optimizer``, and which an engine that does both in one
   call (DeepSpeed, pipelines) implements whole. No built-in overrides ``setup``.
4. **Hot path**: ``forward``, ``backward``, ``clip_grad_norm``,
   ``optimizer_step``, ``zero_grad``, ``to_device``, ``reduce_sum`` (or, where
   ``reports_step_losses`` answers a bool, one sum over the world; API 2.4).
5. **State**: ``full_state_dict`` (canonical), ``save_state`` / ``load_state``.
   The helpers most strategies need are here too: :func:`canonical`,
   :func:`dcp_save`, :func:`dcp_load` (``torch.distributed.checkpoint`` in the
   layout every torch strategy shares, so checkpoints cross backends).

The trainer never branches on a strategy's class or name: where the loop
differs per backend, it reads the declaration.

One module past the project's 400 lines on purpose: the contract is read top
to bottom, in the order above, and splitting it would scatter one reading.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from unison.contract.env import DistEnv, resolve_accelerator
from unison.contract.ownership import (
    AccumulationOwner,
    Feature,
    GradAccumulation,
    GradSync,
    LossDivisor,
    LossNormalisation,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
    Reduction,
    ReplicaInit,
    StateDictDeclaration,
    StateDictKind,
    WorldSizes,
)
from unison.contract.settings import TrainerSettings
from unison.contract.spec import StrategySpec
from unison.contract.state import canonical, dcp_load, dcp_save

# Moved to unison.contract.tensor_parallel; imported here so the public name of API 2.1 keeps working.
from unison.contract.tensor_parallel import PlanHooks, tensor_parallel_plan
from unison.contract.tensors import move_to_device
from unison.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from unison.contract.precision import Precision

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


# --------------------------------------------------------------------------- #
# The three accumulation interfaces (one per declared owner)
# --------------------------------------------------------------------------- #


@runtime_checkable
class DeferredGradSync(Protocol):
    """Trainer-owned accumulation with gradients synchronised at the boundary only."""

    def no_sync(self) -> AbstractContextManager[Any]:
        """Skip gradient synchronisation for the micro-step run inside the context.

        The trainer enters it on every micro-step of an optimizer step but the
        last, so gradients add up locally and are synchronised once.
        """
        ...


@runtime_checkable
class EngineAccumulation(Protocol):
    """Engine-owned accumulation (DeepSpeed): the engine scales the loss and decides the boundary."""

    def is_accumulation_boundary(self) -> bool:
        """After ``backward``: does the engine consider this micro-step the last of the optimizer step?

        The trainer checks it against its own count at every micro-step and
        fails loudly on a disagreement.
        """
        ...


@runtime_checkable
class ScheduleAccumulation(Protocol):
    """Schedule-owned accumulation (pipelines): one call runs every micro-batch of a step."""

    def forward_backward(
        self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, precision: Precision
    ) -> list[torch.Tensor]:
        """Run forward and backward over all ``(inputs, targets)`` micro-batches; return each one's loss.

        Gradients must end up as the mean over micro-batches; losses are
        undivided and returned on every rank (API 2.4: a strategy whose
        :meth:`Strategy.reports_step_losses` answers ``False`` on a rank need
        not send its losses there: it returns as many values of the same form,
        whose values the trainer replaces by zeros). A strategy that declares
        ``Ownership.loss_normalisation`` (API 2.3) also takes a ``loss_fn``
        returning ``(loss_sum, num_items)``: it backpropagates ``loss_sum`` as
        it would a mean loss and returns each micro-batch's pair
        ``(loss_sum, num_items)`` (0-dim tensors) on every rank; it may return
        a mean loss as ``(loss, -1)`` (stages that do not compute the loss
        cannot know its form without reading the device).
        """
        ...


def required_interface(accumulation: GradAccumulation) -> type | None:
    """The interface a strategy declaring ``accumulation`` must implement (``None``: none)."""
    if accumulation.owner is AccumulationOwner.TRAINER:
        return DeferredGradSync if accumulation.sync is GradSync.BOUNDARY else None
    if accumulation.owner is AccumulationOwner.ENGINE:
        return EngineAccumulation
    return ScheduleAccumulation


def check_contract(strategy: Strategy) -> None:
    """Refuse, before any process group, a strategy that lacks its declared owner's interface."""
    accumulation = strategy.ownership.grad_accumulation
    interface = required_interface(accumulation)
    if interface is not None and not isinstance(strategy, interface):
        method = next(iter(n for n in vars(interface) if not n.startswith("_")))
        raise ConfigurationError(
            "strategy",
            f"strategy {strategy.name!r} ({type(strategy).__qualname__}) declares {accumulation.owner.value}-owned "
            f"gradient accumulation{' synchronised at the boundary' if interface is DeferredGradSync else ''} but "
            f"does not implement {method}()",
            f"implement {interface.__name__}.{method}() in the strategy"
            + (
                ", or declare GradAccumulation(sync=GradSync.EVERY_MICRO_STEP)" if interface is DeferredGradSync else ""
            ),
        )


def model_features(model: torch.nn.Module, plugins: PlanHooks | None = None) -> dict[Feature, str]:
    """The :class:`Feature` values a model needs (tied weights, frozen parameters, buffers,
    an arbitrary module, no tensor-parallel plan), each with the evidence; the conformance suite uses
    it to know which declared refusals a scenario may meet. ``plugins``: the plugin manager whose
    ``unison_tensor_parallel_plan`` implementations may plan the model's blocks
    (:func:`~unison.contract.tensor_parallel.tensor_parallel_plan`; ``None``: the model's own plan only)."""
    needs: dict[Feature, str] = {}
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen and Feature.TIED_WEIGHTS not in needs:
            needs[Feature.TIED_WEIGHTS] = f"{name!r} is {seen[id(p)]!r}"
        seen.setdefault(id(p), name)
        if not p.requires_grad and Feature.FROZEN_PARAMETERS not in needs:
            needs[Feature.FROZEN_PARAMETERS] = f"{name!r} does not require grad"
    buffer = next(iter(model.named_buffers()), None)
    if buffer is not None:
        needs[Feature.BUFFERS] = f"buffer {buffer[0]!r}"
    if not isinstance(model, torch.nn.Sequential) and getattr(model, "pipeline_layers", None) is None:
        needs[Feature.ARBITRARY_MODULE] = f"{type(model).__name__} is not an nn.Sequential and has no pipeline_layers"
    if tensor_parallel_plan(model, plugins) is None:
        needs[Feature.NO_TENSOR_PARALLEL_PLAN] = f"{type(model).__name__} declares no tp_plan or base_model_tp_plan" + (
            "" if plugins is None else ", and no plugin's unison_tensor_parallel_plan knows its blocks"
        )
    return needs


# --------------------------------------------------------------------------- #
# The base class
# --------------------------------------------------------------------------- #


class Strategy(abc.ABC):
    """Base class of every backend. Subclasses declare, then implement.

    Construction must be cheap and must not touch a process group or a device:
    ``unison describe`` builds strategies only to read :attr:`ownership`.
    """

    #: The name the strategy was created under (set by the registry).
    name: str = "?"
    #: The plugin API version the class was written against (:data:`~unison.contract.version.API_VERSION`);
    #: ``None``: not declared, read from the ``setup`` signature at registration.
    api_version: str | None = None
    #: The run's plugin manager, bound when the trainer builds the strategy (``None`` outside a run),
    #: for the hooks a strategy asks about the user's model: ``unison_tensor_parallel_plan`` (API 2.2).
    plugins: PlanHooks | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A setup override written for API 2.0 never runs apply_features (2.1): its declaration refuses
        # compile and activation checkpointing, with the reason (unison.contract.compat).
        from unison.contract.compat import declare_features_out

        declare_features_out(cls)

    def __init__(self) -> None:
        #: This rank's place in the world: bound by the trainer before it calls :meth:`setup` (and by the
        #: template from its ``env=``), so an overriding ``setup`` finds it bound; ``None`` until then.
        self.env: DistEnv | None = None
        #: The user's module, unwrapped (canonical names come from it).
        self.module: torch.nn.Module | None = None
        #: What the trainer calls in forward (a DDP/FSDP/engine wrapper).
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        #: Bound like :attr:`env`: by the trainer before it calls :meth:`setup`, and by the template from its
        #: arguments (``None`` until then).
        self.precision: Precision | None = None
        self.settings: TrainerSettings | None = None

    # -- 1. declaration (no process group) ---------------------------------- #
    @property
    @abc.abstractmethod
    def ownership(self) -> Ownership:
        """The frozen declaration of what this configured strategy owns and refuses."""

    def process_group_backend(self, device: torch.device) -> str | None:
        """The ``torch.distributed`` backend to initialise, or ``None`` for none."""
        return "nccl" if device.type == "cuda" else "gloo"

    def data_parallel_size(self, world_size: int) -> int:
        """How many data-parallel replicas split each micro-batch."""
        return world_size

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        """This rank's index among the data-parallel replicas."""
        return rank

    def validate(self, settings: TrainerSettings, world_size: int) -> None:
        """Reject impossible settings before any process group starts.

        Raise :class:`~unison.errors.ConfigurationError` naming the option and
        the fix. The trainer has already enforced the declaration (precision,
        refused features, world sizes) and batch divisibility; implement only
        strategy-specific checks here.
        """

    def validate_model(self, model: torch.nn.Module, settings: TrainerSettings) -> None:
        """Reject a model this strategy cannot train, before any process group starts."""

    def validate_optimizer(self, optimizer: torch.optim.Optimizer, settings: TrainerSettings) -> None:
        """Reject the user's optimizer before any process group starts.

        ``optimizer`` is what the user's factory returned when the trainer
        probed it on the model's trainable parameters (a throwaway instance:
        :meth:`setup` calls the factory again). Only a strategy whose engine
        takes the optimizer's hyper-parameters rather than the optimizer (apex's
        ``DistributedFusedAdam`` is an Adam) needs this.
        """

    # -- 3. setup: a template method ------------------------------------------ #
    # The public method fixes the order every backend needs (env bound -> module
    # on its device -> wrapped -> optimizer over what the wrapper trains) and sets
    # module, model and optimizer, so no strategy can build the optimizer before
    # the wrapper replaced the parameters or forget an attribute; the hooks
    # implement what differs per backend (torchtitan's checkpointer: public
    # methods guard, hooks implement). A backend whose engine wraps and builds
    # the optimizer in one call (DeepSpeed, pipelines) implements build, so the
    # binding and the features stay the template's for every strategy.
    def setup(
        self,
        module: torch.nn.Module,
        make_optimizer: OptimizerFactory,
        *,
        env: DistEnv | None = None,
        precision: Precision,
        settings: TrainerSettings,
    ) -> None:
        """Move, transform, wrap, build the optimizer: ``configure_module`` -> ``apply_features`` ->
        ``build`` (by default ``wrap_module`` -> ``build_optimizer``).

        Called once per ``fit`` on every rank, after the process group exists.
        ``env`` is this rank's place in the world (``None`` keeps the
        :attr:`env` bound before the call). ``precision`` is the one
        way precision reaches a strategy: ``precision.name`` and
        ``precision.support`` (the declared :class:`PrecisionSupport`); when the
        trainer applies it, ``precision.convert_module`` has already run.
        Binds :attr:`env`, :attr:`precision` and :attr:`settings` for the hooks,
        then sets :attr:`module`, :attr:`model` and :attr:`optimizer`.

        The trainer binds :attr:`env`, :attr:`precision` and :attr:`settings` on
        the strategy before it calls this (and passes them too), so an override
        (an engine that wraps and builds the optimizer in one call) finds them
        bound whether or not it binds them itself. An engine that wraps and
        builds the optimizer in one call implements :meth:`build` (API 2.3)
        rather than overriding this. An override runs no
        :meth:`apply_features`: one written for API 2.0 has its declaration
        refuse ``compile`` and ``activation_checkpointing`` with the reason
        (:mod:`unison.contract.compat`); from 2.1 on, an override applies them
        or declares them refused.
        """
        if env is not None:
            self.env = env
        if self.env is None:
            raise TypeError(f"{type(self).__qualname__}.setup() needs env= (or env bound before the call)")
        self.precision, self.settings = precision, settings
        self.module = self.configure_module(module)
        self.apply_features(self.module)
        self.model, self.optimizer = self.build(self.module, make_optimizer)

    def build(self, module: torch.nn.Module, make_optimizer: OptimizerFactory) -> tuple[Any, torch.optim.Optimizer]:
        """Hook: what forward calls and the optimizer, from the configured, featured ``module`` (API 2.3).

        Default: :meth:`wrap_module`, then :meth:`build_optimizer` over what the
        wrapper trains (so a wrapper that replaces parameters, FSDP, is seen by
        the optimizer). An engine whose one call does both (``deepspeed.initialize``,
        a pipeline's stages and schedule, a wrapper that needs its optimizer
        first) implements this instead of overriding :meth:`setup`; it may also
        replace :attr:`module` with the module this rank trains (a pipeline
        stage's layers), from which canonical names come.
        """
        self.model = self.wrap_module(module)
        return self.model, self.build_optimizer(make_optimizer)

    def configure_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Hook: the module this rank trains, unwrapped (default: ``module`` moved to :attr:`env`'s device)."""
        assert self.env is not None
        return module.to(self.env.device)

    def apply_features(self, module: torch.nn.Module) -> None:
        """Hook: apply the run's module features to ``module`` in place, before :meth:`wrap_module`.

        Default: activation checkpointing of the blocks (``settings.activation_checkpointing``), then
        ``torch.compile`` of the whole forward (``settings.compile``), torchtitan's order; see
        :mod:`unison.contract.transforms`. The compiled forward runs inside the wrapper (as Lightning and
        torchtitan compile under DDP), so the wrapper's hooks stay outside the graph. A strategy that
        cannot apply a feature declares it in ``Ownership.refuses`` (:attr:`Feature.COMPILE`,
        :attr:`Feature.ACTIVATION_CHECKPOINTING`), and the trainer refuses the run before any process
        group; one that overrides ``setup`` applies them itself or declares them refused.
        """
        from unison.contract.transforms import checkpoint_blocks, compile_forward, compile_options

        assert self.settings is not None
        if self.settings.activation_checkpointing is not None:
            checkpoint_blocks(module, self.settings.activation_checkpointing)
        options = compile_options(self.settings.compile)
        if options is not None:
            compile_forward(module, options)

    def wrap_module(self, module: torch.nn.Module) -> Any:
        """Hook: what the trainer calls in forward (a DDP/FSDP wrapper; default: ``module`` itself)."""
        return module

    def build_optimizer(self, make_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        """Hook: the optimizer, after :meth:`wrap_module` (default: the factory over :attr:`module`'s parameters)."""
        assert self.module is not None
        return make_optimizer(self.module.parameters())

    # -- 4. hot path -------------------------------------------------------- #
    def forward(self, inputs: Any) -> Any:
        """The model's forward for the ``loss_fn`` form (``training_step`` gets :attr:`model`)."""
        return self.model(inputs)

    def to_device(self, batch: Any, *, non_blocking: bool = False) -> Any:
        """Move every tensor leaf of ``batch`` to this rank's device.

        A strategy may narrow this (a pipeline stage needs only part of a batch).
        """
        assert self.env is not None
        return move_to_device(batch, self.env.device, non_blocking=non_blocking)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def scale_gradients(self, factor: torch.Tensor) -> None:
        """Multiply this rank's gradients by ``factor`` (a 0-dim tensor on :attr:`env`'s device), in place.

        Called once per optimizer step, after the last backward and before
        ``clip_grad_norm``, only for a loss in the ``(loss_sum, num_items)``
        form: ``factor`` turns the summed gradients into the mean over the
        step's global item count (:class:`~unison.contract.ownership.LossNormalisation`).
        The default scales ``.grad`` of :attr:`module`'s parameters (a DTensor's
        local shard), which is where every wrapper on the trainer's path keeps
        them; an engine keeping gradients elsewhere overrides it (API 2.3). The
        factor stays on the device: no host synchronisation.
        """
        assert self.module is not None
        grads: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.module.parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grads.setdefault(grad.dtype, []).append(grad)
        from unison._upstream.torch import scale_tensors

        for dtype, tensors in grads.items():
            scale_tensors(tensors, factor.to(device=tensors[0].device, dtype=dtype))

    @abc.abstractmethod
    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Return the global pre-clip L2 grad norm over all shards; clip when ``max_norm`` is set."""

    def optimizer_step(self) -> bool:
        """Update the parameters; return ``True`` if the engine skipped the update.

        Engines that own loss scaling (DeepSpeed fp16) report their own
        overflow skips here; a trainer-applied GradScaler decides before this
        is called.
        """
        assert self.optimizer is not None
        self.optimizer.step()
        return False

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        zero_grad = self.optimizer.zero_grad
        # Free the gradients. apex's fused optimizers (FusedAdam, FusedLAMB)
        # override zero_grad() without the set_to_none argument and free them
        # themselves (set_grad_none=True, their default).
        if _takes_set_to_none(type(self.optimizer)):
            zero_grad(set_to_none=True)
        else:
            zero_grad()

    def eval_loss(self, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """The mean loss of one validation batch in the ``loss_fn`` form (under ``torch.no_grad``)."""
        return loss_fn(self.forward(inputs), targets)

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over data-parallel replicas, element by element; returned on every rank, on this
        rank's device.

        The trainer calls it once per optimizer step with the micro-batches' losses (and item and token
        counts), unless :meth:`reports_step_losses` answers a bool; on the CPU, where the replicas are the
        whole world, two more numbers of its own ride along (the stop flags,
        :mod:`unison.training.stopping`), so an override sums every element it is given. Validation sums
        its losses with it too.
        """
        assert self.env is not None
        out = tensor.detach().to(self.env.device)
        if not self.env.distributed or self.data_parallel_size(self.env.world_size) == 1:
            return out  # one replica (a pipeline over the whole world): nothing to sum over
        out = out.clone()
        torch.distributed.all_reduce(out, group=self.data_parallel_group())
        return out

    def reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` over data-parallel replicas; returned on every rank, on this rank's device."""
        assert self.env is not None
        return self.reduce_sum(tensor) / self.data_parallel_size(self.env.world_size)

    def data_parallel_group(self) -> Any:
        """The process group of this rank's data-parallel replicas (``None``: the world)."""
        return None

    def reports_step_losses(self) -> bool | None:
        """How the step's losses reach every rank (plugin API 2.4); asked once per fit, after :meth:`setup`.

        ``None`` (the default, and the only form before 2.4): every rank holds
        its replica's losses after ``forward_backward`` / ``backward``, and the
        trainer sums the step's numbers (each micro-batch's loss and item
        count, the step's token count) over the replicas with :meth:`reduce_sum`.

        ``True`` or ``False``: the trainer sums them over every rank of the
        world (the default process group, on this rank's device) instead,
        counting this rank's numbers (``True``) or zeros in their place
        (``False``). Exactly one rank of each data-parallel replica answers
        ``True``, so the sum is the replicas' sum, and it reaches every rank.
        On a ``False`` rank the step's values must still have the same count
        and form (mean or pair) as on the ``True`` rank, since they are summed
        element by element; the trainer replaces their values by zeros. A
        pipeline answers ``True`` on the stage that computes the loss and
        returns zeros on the other stages, with no collective of its own to
        send the losses. Being one
        collective over the world, the sum also carries the trainer's stop
        flags on the CPU (:mod:`unison.training.stopping`).
        """
        return None

    def make_grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """The loss scaler for trainer-applied fp16 (sharded strategies return a sharded one)."""
        return torch.amp.GradScaler(device.type)

    # -- 5. state ----------------------------------------------------------- #
    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Canonical model state: unsharded, fp32, on CPU, the module's own names.

        Collective: call on every rank. Returned on every rank.
        """

    @abc.abstractmethod
    def save_state(self, directory: Path) -> None:
        """Write model and optimizer state into ``directory`` (collective)."""

    @abc.abstractmethod
    def load_state(self, directory: Path) -> None:
        """Restore model and optimizer state from ``directory`` (collective)."""

    def memory_footprint(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state.

        A DTensor counts its local shard (``to_local()``), the bytes this rank
        really holds; gradients count one per trainable parameter, the size of
        what exists at the optimizer step. Transient tensors (FSDP's all-gathered
        parameters, freed after forward or backward) are not counted.
        """
        assert self.module is not None and self.optimizer is not None

        def nbytes(t: torch.Tensor) -> int:
            local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
            return local.numel() * local.element_size()

        params = list(self.module.parameters())
        return {
            "parameters": sum(nbytes(p) for p in params),
            "gradients": sum(nbytes(p) for p in params if p.requires_grad),
            "optimizer_state": sum(
                nbytes(t)
                for s in self.optimizer.state.values()
                for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0
            ),
        }

    def teardown(self) -> None:
        """Release what setup made; called once at the end of every ``fit``."""
        self.model = self.optimizer = None


__all__ = [
    "AccumulationOwner",
    "DeferredGradSync",
    "DistEnv",
    "EngineAccumulation",
    "Feature",
    "GradAccumulation",
    "GradSync",
    "LossDivisor",
    "LossFn",
    "LossNormalisation",
    "OptimizerFactory",
    "Ownership",
    "PrecisionOwner",
    "PrecisionSupport",
    "Reduction",
    "ReplicaInit",
    "ScheduleAccumulation",
    "StateDictDeclaration",
    "StateDictKind",
    "Strategy",
    "StrategySpec",
    "TrainerSettings",
    "WorldSizes",
    "canonical",
    "check_contract",
    "dcp_load",
    "dcp_save",
    "model_features",
    "required_interface",
    "resolve_accelerator",
    "tensor_parallel_plan",
]


_SET_TO_NONE: dict[Any, bool] = {}


def _takes_set_to_none(optimizer_type: Any) -> bool:
    """Whether ``optimizer_type.zero_grad`` accepts ``set_to_none`` (read once per class, not per step)."""
    known = _SET_TO_NONE.get(optimizer_type)
    if known is None:
        known = _SET_TO_NONE[optimizer_type] = "set_to_none" in inspect.signature(optimizer_type.zero_grad).parameters
    return known
