"""NVIDIA apex AMP precisions: ``apex-O1`` and ``apex-O2``.

Registered on every machine so that ``unison precisions`` and error messages
name them; usable only where ``from apex import amp`` works (NVIDIA apex,
built from https://github.com/NVIDIA/apex, with CUDA). Otherwise each
:class:`~unison.registry.PrecisionSpec` says precisely why not. A missing apex
is never replaced by ``torch.autocast``: the two differ in what they cast
(O2 keeps fp16 model weights and fp32 master weights in the optimizer), so a
silent substitute would change the numbers a user asked for.

How a strategy uses it
----------------------
A precision is used only where the strategy declares it (``Ownership.precision``
maps the name to ``PrecisionOwner.PLUGIN``); the built-in strategies declare
the four standard names only. ``amp.initialize`` needs both the model and the
optimizer and must run before any data-parallel wrapper (DDP registers its
gradient buckets by dtype), so a strategy that declares an apex precision calls
:meth:`ApexAmpPrecision.initialize` in its ``setup`` between building the
optimizer and wrapping the model. Every hot-path method refuses to run before
that call rather than training in fp32 unnoticed.

How it maps onto the trainer's precision calls
-----------------------------------------------
apex scales a loss through a context manager,
``with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()``, whose
exit unscales the gradients and checks for overflow. The trainer instead calls
``scale_loss`` (before backward), ``unscale_gradients`` (once per optimizer
step, before clipping) and ``step``. So: ``scale_loss`` enters
``amp.scale_loss(..., delay_unscale=True)`` and returns the scaled loss; the
context is closed (without unscaling) at the next micro-step;
``unscale_gradients`` closes the last one and runs one more ``amp.scale_loss``
without delay on a zero loss that touches every trainable parameter, which
makes apex unscale the accumulated gradients (into the fp32 master gradients
for O2), check them for overflow and update the loss scale. ``step`` always
calls the optimizer step (on overflow apex has patched it to skip once, and
that patch must be consumed) and reports the skip from the global grad norm.

For O2 the gradients to clip are the optimizer's fp32 master gradients
(``amp.master_params(optimizer)``), not the module's fp16 ones: a strategy
declaring ``apex-O2`` must clip those.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Callable

import torch

from unison.plugin import hookimpl
from unison.precision import Precision
from unison.registry import PrecisionSpec

NOT_INSTALLED = "NVIDIA apex is not installed (the PyPI package named apex is unrelated)"


def apex_unavailable() -> str | None:
    """Why ``from apex import amp`` cannot be used here, or ``None``.

    ``find_spec("apex")`` first, so a machine without apex imports nothing.
    """
    if importlib.util.find_spec("apex") is None:
        return NOT_INSTALLED
    try:
        from apex import amp  # noqa: F401
    except Exception as exc:  # a broken build raises more than ImportError
        return (
            f"'from apex import amp' fails ({type(exc).__name__}: {exc}); the installed 'apex' is not a working "
            "NVIDIA apex (the PyPI package named apex is unrelated): build it from https://github.com/NVIDIA/apex"
        )
    if not torch.cuda.is_available():
        return "NVIDIA apex AMP needs CUDA, and CUDA is not available"
    return None


class ApexAmpPrecision(Precision):
    """apex AMP at one ``opt_level`` ("O1": patched casts; "O2": fp16 model, fp32 master weights)."""

    def __init__(self, name: str, opt_level: str) -> None:
        from apex import amp  # the spec's availability check already passed

        self.name, self.opt_level, self._amp = name, opt_level, amp
        self._module: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._open: Any = None  # the amp.scale_loss context of the last micro-step

    def initialize(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """``amp.initialize``: call in the strategy's setup, after building the optimizer, before wrapping."""
        module, optimizer = self._amp.initialize(module, optimizer, opt_level=self.opt_level, verbosity=0)
        self._module, self._optimizer = module, optimizer
        return module, optimizer

    def _require(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            raise RuntimeError(
                f"precision {self.name!r} was not initialised: the strategy declaring it must call "
                "precision.initialize(module, optimizer) in setup, before wrapping the model"
            )
        return self._optimizer

    def _close(self) -> None:
        if self._open is not None:
            context, self._open = self._open, None
            context.__exit__(None, None, None)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        optimizer = self._require()
        self._close()  # the previous micro-step's backward has run
        context = self._amp.scale_loss(loss, optimizer, delay_unscale=True)
        scaled = context.__enter__()
        self._open = context
        return scaled

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self._require()
        self._close()
        assert self._module is not None
        params = [p for p in self._module.parameters() if p.requires_grad]
        # A zero loss over every trainable parameter: its backward adds zeros,
        # and the context's exit (no delay) unscales what accumulated, checks
        # for overflow and updates the loss scale.
        zero = torch.stack([(p * 0).sum().float() for p in params]).sum()
        with self._amp.scale_loss(zero, self._optimizer) as scaled:
            scaled.backward()

    def step(self, optimizer_step: Callable[[], bool], optimizer: torch.optim.Optimizer, finite: bool) -> bool:
        self._require()
        # On overflow apex patched optimizer.step to skip once: call it anyway
        # so the patch is consumed, and report the skip.
        engine_skipped = bool(optimizer_step())
        return engine_skipped or not finite

    def state_dict(self) -> dict[str, Any]:
        return {"amp": self._amp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "amp" in state:
            self._amp.load_state_dict(state["amp"])


@hookimpl
def unison_precisions() -> list[PrecisionSpec]:
    unavailable = apex_unavailable()
    return [
        PrecisionSpec(
            "apex-O1",
            lambda device, grad_scaler: ApexAmpPrecision("apex-O1", "O1"),
            "NVIDIA apex AMP O1: fp16 casts patched per op, fp32 weights, dynamic loss scaling",
            unavailable=unavailable,
        ),
        PrecisionSpec(
            "apex-O2",
            lambda device, grad_scaler: ApexAmpPrecision("apex-O2", "O2"),
            "NVIDIA apex AMP O2: fp16 model, fp32 master weights in the optimizer, dynamic loss scaling",
            unavailable=unavailable,
        ),
    ]
