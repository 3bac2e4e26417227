"""Hand-written data parallel as a third-party unison strategy plugin.

Everything here uses unison's public API only: a :class:`unison.Strategy`
subclass declares its :class:`unison.Ownership` and implements the typed hot
path; a module-level ``unison_strategies`` hook registers it by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import unison
from unison import (
    AccumulationOwner,
    ConfigurationError,
    GradAccumulation,
    GradSync,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
    StateDictDeclaration,
    StateDictKind,
    StrategySpec,
)
from unison.contract.state import canonical, dcp_load, dcp_save

_PRECISION = {
    "32-true": PrecisionSupport(PrecisionOwner.TRAINER, "fp32 parameters, gradients all-reduced in fp32"),
    "bf16-mixed": PrecisionSupport(PrecisionOwner.TRAINER, "torch.autocast(bfloat16); fp32 gradients all-reduced"),
    "16-mixed": PrecisionSupport(PrecisionOwner.TRAINER, "torch.autocast(float16) + GradScaler by the trainer"),
    "bf16-true": PrecisionSupport.unsupported(
        "gradients are summed across ranks in their own dtype, and bf16 sums lose the low bits; use bf16-mixed"
    ),
}


class HandwrittenDataParallel(unison.Strategy):
    """Whole model on every rank; one flattened all-reduce after the last micro-batch.

    Trainer-owned accumulation: the trainer enters :meth:`no_sync` on every
    micro-step but the last, so gradients add up locally and are averaged
    across ranks once per optimizer step.
    """

    #: How many times the all-reduced gradients are divided by the world size.
    averaging_passes = 1

    def __init__(self) -> None:
        super().__init__()
        self._sync = True

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER,
                "no_sync() defers the all-reduce; backward() of the boundary micro-batch all-reduces every "
                "gradient in one flattened buffer and divides by the world size",
            ),
            precision=_PRECISION,
            state_dict=StateDictDeclaration(
                kind=StateDictKind.FULL,
                format="torch.distributed.checkpoint (DCP), keys = module parameter names",
                reshardable=True,
                canonical_export="module.state_dict() on every rank, fp32, on CPU",
            ),
        )

    def setup(self, module: torch.nn.Module, make_optimizer: Any, *, precision: Any, settings: Any) -> None:
        # The trainer bound self.env and already made every replica start from
        # rank 0's weights (the declaration's default replica_init="trainer").
        assert self.env is not None
        module = module.to(self.env.device)
        self.module = self.model = module
        self.optimizer = make_optimizer(module.parameters())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._sync and self.env is not None and self.env.distributed:
            self._average_gradients()

    def _average_gradients(self) -> None:
        assert self.module is not None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        world = dist.get_world_size()
        for _ in range(self.averaging_passes):
            flat.div_(world)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None
        params = [p for p in self.module.parameters() if p.grad is not None]
        # Gradients are identical on every rank after the all-reduce: the local norm is global.
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        return canonical(self.module.state_dict())

    def save_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None
        dcp_save(self.module, self.optimizer, directory)

    def load_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None
        dcp_load(self.module, self.optimizer, directory)


class DoubleAveragingDataParallel(HandwrittenDataParallel):
    """Deliberately wrong: exists so the conformance suite can be seen failing.

    Two defects: gradients are divided by the world size twice (a classic bug
    when a loss is already averaged and the reduction averages again), and
    ``validate`` refuses ``bf16-true`` although the ownership declares it
    supported (a declaration that lies).
    """

    averaging_passes = 2

    @property
    def ownership(self) -> Ownership:
        own = super().ownership
        return Ownership(
            grad_accumulation=own.grad_accumulation,
            precision={**own.precision, "bf16-true": PrecisionSupport(PrecisionOwner.TRAINER, "module.to(bfloat16)")},
            state_dict=own.state_dict,
        )

    def validate(self, settings: Any, world_size: int) -> None:
        if settings.precision == "bf16-true":
            raise ConfigurationError("precision", "bf16-true is not implemented", "use bf16-mixed")


class EveryMicroStepDataParallel(unison.Strategy):
    """Averages gradients after *every* micro-batch's backward: more communication, the same numbers.

    It has no ``no_sync()``: its ownership declares trainer-owned accumulation
    with ``GradSync.EVERY_MICRO_STEP``, so the trainer enters none, and the
    conformance suite checks one full gradient sync per micro-step. Each
    micro-step's gradient is averaged over ranks before it is added to the
    accumulated one (``param.grad`` holds the running sum): averaging is linear,
    so the result equals averaging once at the boundary.
    """

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER,
                "backward() of every micro-batch all-reduces (mean) that micro-batch's gradient in one flattened "
                "buffer and adds it to the accumulated gradient",
                sync=GradSync.EVERY_MICRO_STEP,
            ),
            precision=_PRECISION,
            state_dict=StateDictDeclaration(
                kind=StateDictKind.FULL,
                format="torch.distributed.checkpoint (DCP), keys = module parameter names",
                reshardable=True,
                canonical_export="module.state_dict() on every rank, fp32, on CPU",
            ),
        )

    def setup(self, module: torch.nn.Module, make_optimizer: Any, *, precision: Any, settings: Any) -> None:
        assert self.env is not None
        module = module.to(self.env.device)
        self.module = self.model = module
        self.optimizer = make_optimizer(module.parameters())

    def backward(self, loss: torch.Tensor) -> None:
        assert self.module is not None
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.env is None or not self.env.distributed:
            loss.backward()
            return
        # This micro-step's gradient alone, averaged, then added to the running sum.
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
        flat = _flatten_dense_tensors([g for _, g in pairs])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        for (p, _), reduced in zip(pairs, _unflatten_dense_tensors(flat, [g for _, g in pairs])):
            if p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.add_(reduced)

    clip_grad_norm = HandwrittenDataParallel.clip_grad_norm
    full_state_dict = HandwrittenDataParallel.full_state_dict
    save_state = HandwrittenDataParallel.save_state
    load_state = HandwrittenDataParallel.load_state


@unison.hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="handwritten_dp",
            factory=HandwrittenDataParallel,
            description="hand-written data parallel: one flattened gradient all-reduce per optimizer step",
        ),
        StrategySpec(
            name="handwritten_dp_double_avg",
            factory=DoubleAveragingDataParallel,
            description="deliberately wrong: averages gradients twice (a conformance-suite example)",
        ),
        StrategySpec(
            name="handwritten_dp_every_step",
            factory=EveryMicroStepDataParallel,
            description="hand-written data parallel that all-reduces at every micro-step (declared)",
        ),
    ]
