"""torch internals used by unison's strategies (verified against torch 2.13.0).

* ``torch._utils._flatten_dense_tensors`` / ``_unflatten_dense_tensors``: one flat
  buffer for one collective over many gradients (what DDP's buckets do). No public
  equivalent exists; ``torch.cat`` + ``split`` would be the fallback.
* ``torch.amp.GradScaler`` internals: ``_unscale_grads_`` (the one place where the
  per-device overflow flags exist before ``step()`` reads them), ``_lazy_init_scale_growth_tracker``,
  ``_enabled``, ``_scale``, ``_device``. :class:`FlagReducingGradScaler` exposes them as
  two public methods, so strategies override those instead.
* ``PipelineStage._forward_metadata_inference``: the pipeline stage's one-time shape
  inference, wrapped by :func:`buffer_keeping_pipeline_stage` so that it leaves buffers as
  they were.
* ``Optimizer._optimizer_step_pre_hooks`` / ``_optimizer_step_post_hooks``: the step
  hooks a user registered on an optimizer, moved to the optimizer that really steps
  (:func:`copy_step_hooks`). torch has ``register_step_*_hook`` but no getter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unison._upstream import warn_if_unverified

VERIFIED_VERSION = "2.13.0"


def _check() -> None:
    warn_if_unverified("torch", VERIFIED_VERSION, __name__)


def flatten_dense_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding ``tensors`` back to back."""
    _check()
    # PRIVATE torch._utils: the flattening DDP and fairscale use for bucketed collectives.
    return torch._utils._flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (the inverse of :func:`flatten_dense_tensors`)."""
    # PRIVATE torch._utils: the inverse of the flattening above.
    return list(torch._utils._unflatten_dense_tensors(flat, tensors))


class FlagReducingGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose overflow check a strategy can narrow and combine across ranks.

    Override :meth:`unscale_target` to unscale and check only some gradients (the shard
    this rank owns) and :meth:`combine_found_inf` to combine the per-device overflow
    flags over ranks, so that every rank skips, backs off and grows its scale together.
    """

    def unscale_target(self, optimizer: Any) -> Any:
        """The object whose ``param_groups`` are unscaled and checked (default: the optimizer)."""
        return optimizer

    def combine_found_inf(
        self, per_device: dict[torch.device, torch.Tensor], found_inf: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """Combine the overflow flags (in place) before ``step()`` reads them; returns the flags to use."""
        return per_device

    def ensure_scale(self, optimizer: Any) -> None:
        """Create the scale on a rank that has not scaled a loss yet (a pipeline stage without the loss).

        ``unscale_`` needs it; it goes on the device of the optimizer's first
        gradient, else on the scaler's own device type.
        """
        _check()
        # PRIVATE GradScaler state: _enabled/_scale say whether the scale exists; the
        # tracker is otherwise created lazily by the first scale(loss), which such a rank never calls.
        if self._enabled and self._scale is None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self._lazy_init_scale_growth_tracker(grads[0].device if grads else torch.device(self._device))

    def _unscale_grads_(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        # PRIVATE GradScaler._unscale_grads_: called by unscale_() with the optimizer; it
        # unscales and returns one found_inf flag per device, which step() then reads. No
        # public hook sits between the two.
        per_device = super()._unscale_grads_(self.unscale_target(optimizer), inv_scale, found_inf, allow_fp16)
        return self.combine_found_inf(per_device, found_inf)


def buffer_keeping_pipeline_stage() -> type:
    """``PipelineStage`` whose one-time shape inference leaves the stage's buffers as they were.

    Before its first step torch runs each stage's forward once, in training mode, to infer
    the shapes it sends (on the first micro-batch at stage 0, on uninitialised tensors of the
    right shape at the others). A forward that updates buffers (BatchNorm's running statistics
    and ``num_batches_tracked``) would keep that extra update, taken from garbage memory or from
    the first micro-batch twice, which no other backend makes; the buffers are therefore
    restored after it. Restored by putting the saved copies in place of the buffer tensors, not
    by copying into them: torch backpropagates through that inference graph next (to infer
    gradient shapes), and an in-place write to a tensor it saved would fail its version check.
    """
    _check()
    from torch.distributed import pipelining

    base = pipelining.PipelineStage
    # PRIVATE PipelineStage._forward_metadata_inference: the one-time shape inference, the only
    # place that runs a stage's forward outside the schedule; no public hook wraps it.
    if not hasattr(base, "_forward_metadata_inference"):
        raise RuntimeError(
            "torch.distributed.pipelining.PipelineStage has no _forward_metadata_inference; "
            f"unison's pipeline strategy was verified against torch {VERIFIED_VERSION}"
        )

    class BufferKeepingStage(base):  # type: ignore[misc,valid-type]  # a class from the lazy import
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            saved = [
                (module, name, buffer.detach().clone())
                for module in self.submod.modules()
                for name, buffer in module.named_buffers(recurse=False)
            ]
            try:
                # PRIVATE PipelineStage._forward_metadata_inference (see above).
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                for module, name, value in saved:
                    setattr(module, name, value)  # replaces the registered buffer (nn.Module.__setattr__)

    return BufferKeepingStage


def copy_step_hooks(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Register every step pre/post hook of ``source`` on ``target`` too (same order)."""
    _check()
    # PRIVATE Optimizer._optimizer_step_pre_hooks/_post_hooks: the OrderedDicts that
    # register_step_pre_hook/register_step_post_hook fill; there is no public getter.
    for hook in source._optimizer_step_pre_hooks.values():
        target.register_step_pre_hook(hook)
    for hook in source._optimizer_step_post_hooks.values():
        target.register_step_post_hook(hook)


__all__ = [
    "VERIFIED_VERSION",
    "FlagReducingGradScaler",
    "buffer_keeping_pipeline_stage",
    "copy_step_hooks",
    "flatten_dense_tensors",
    "unflatten_dense_tensors",
]
