"""The Strategy contract: the typed hot path every backend implements.

A strategy is registered by name through the ``unison_strategies`` hook (see
:mod:`unison.registry`). Hooks are for discovery and lifecycle; the trainer
drives training through the typed methods below, in this order per optimizer
step (``A`` = ``accumulate_grad_batches``)::

    trainer-owned accumulation          engine-owned              schedule-owned
    --------------------------          ------------              --------------
    for i in range(A):                  for i in range(A):        losses = forward_backward(micro_batches)
      with no_sync() if i < A-1:          out = forward(x)
        out = forward(x)                  backward(loss)
        backward(loss / A)                assert is_accumulation_boundary() == (i == A-1)
    norm = clip_grad_norm(max_norm)     norm = clip_grad_norm(max_norm)
    optimizer_step()                    optimizer_step()
    zero_grad()                         zero_grad()

Which column applies is read from :attr:`Strategy.ownership`, never from the
strategy's class or name.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import torch

from unison.errors import ConfigurationError
from unison.ownership import Ownership

if TYPE_CHECKING:  # pragma: no cover
    from unison.precision import Precision
    from unison.trainer import TrainerSettings

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the world, as the trainer found it."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()


class Strategy(abc.ABC):
    """Base class of every backend. Subclasses declare, then implement.

    Construction must be cheap and must not touch a process group or a device:
    ``unison describe`` builds strategies only to read :attr:`ownership`.
    """

    #: The name the strategy was created under (set by the registry).
    name: str = "?"

    def __init__(self) -> None:
        self.env: DistEnv | None = None
        #: The user's module, unwrapped (canonical names come from it).
        self.module: torch.nn.Module | None = None
        #: What the trainer calls in forward (a DDP/FSDP/engine wrapper).
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None

    # -- declaration (no process group) ------------------------------------ #
    @property
    @abc.abstractmethod
    def ownership(self) -> Ownership:
        """The frozen declaration of what this configured strategy owns."""

    def process_group_backend(self, device: torch.device) -> str | None:
        """The ``torch.distributed`` backend to initialise, or ``None`` for none."""
        return "nccl" if device.type == "cuda" else "gloo"

    def data_parallel_size(self, world_size: int) -> int:
        """How many data-parallel replicas split each micro-batch."""
        return world_size

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        """This rank's index among the data-parallel replicas."""
        return rank

    def validate(self, settings: "TrainerSettings", world_size: int) -> None:
        """Reject impossible settings before any process group starts.

        Raise :class:`~unison.errors.ConfigurationError` naming the option and
        the fix. The trainer has already checked precision support and batch
        divisibility; implement only strategy-specific checks here.
        """

    def validate_model(self, model: torch.nn.Module, settings: "TrainerSettings") -> None:
        """Reject a model this strategy cannot train, before any process group starts."""

    # -- setup -------------------------------------------------------------- #
    @abc.abstractmethod
    def setup(
        self,
        module: torch.nn.Module,
        make_optimizer: OptimizerFactory,
        *,
        precision: "Precision",
        env: DistEnv,
        settings: "TrainerSettings",
    ) -> None:
        """Move and wrap ``module``, build the optimizer, set the attributes.

        Called once per ``fit`` on every rank after the process group exists
        and the seed was set. Must set :attr:`module`, :attr:`model` and
        :attr:`optimizer`. ``precision.convert_module`` has already been
        applied when the trainer owns the precision.
        """

    # -- hot path ----------------------------------------------------------- #
    def forward(self, inputs: Any) -> Any:
        return self.model(inputs)

    def no_sync(self) -> ContextManager[Any]:
        """Skip gradient synchronisation for one micro-step.

        Required of strategies declaring trainer-owned accumulation that
        synchronise gradients; the default refuses rather than pretending.
        """
        raise NotImplementedError(f"strategy {self.name!r} declares trainer-owned accumulation but has no no_sync()")

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def is_accumulation_boundary(self) -> bool:
        """For engine-owned accumulation: does the engine consider this micro-step a boundary?"""
        raise NotImplementedError(f"strategy {self.name!r} does not own accumulation")

    def forward_backward(
        self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, precision: "Precision"
    ) -> list[torch.Tensor]:
        """For schedule-owned accumulation: run every micro-batch; return each one's loss.

        Gradients must end up as the mean over micro-batches.
        """
        raise NotImplementedError(f"strategy {self.name!r} does not run a schedule")

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
        self.optimizer.zero_grad(set_to_none=True)

    def eval_loss(self, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """The mean loss of one validation batch (called under ``torch.no_grad``)."""
        return loss_fn(self.forward(inputs), targets)

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over data-parallel replicas; returned on every rank, on CPU."""
        assert self.env is not None
        if not self.env.distributed:
            return tensor.cpu()
        out = tensor.detach().to(self.env.device).clone()
        torch.distributed.all_reduce(out, group=self.data_parallel_group())
        return out.cpu()

    def reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` over data-parallel replicas; returned on every rank, on CPU."""
        assert self.env is not None
        return self.reduce_sum(tensor) / self.data_parallel_size(self.env.world_size)

    def data_parallel_group(self) -> Any:
        """The process group of this rank's data-parallel replicas (``None``: the world)."""
        return None

    def make_grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """The loss scaler for trainer-applied fp16 (sharded strategies return a sharded one)."""
        return torch.amp.GradScaler(device.type)

    # -- state -------------------------------------------------------------- #
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
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        assert self.module is not None and self.optimizer is not None
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        grads = sum(p.numel() * p.element_size() for p in self.module.parameters() if p.requires_grad)
        optim = sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        return {"parameters": params, "gradients": grads, "optimizer_state": optim}

    def teardown(self) -> None:
        """Release what setup made; called once at the end of every ``fit``."""
        self.model = self.optimizer = None


def unsupported_option(strategy: str, option: str, fix: str) -> ConfigurationError:
    """The error for an option a strategy does not have."""
    return ConfigurationError(f"strategy_options.{option}", f"strategy {strategy!r} has no option {option!r}", fix)

