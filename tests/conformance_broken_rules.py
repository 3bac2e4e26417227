"""More deliberately wrong strategies, one per diagnosis rule the suite names (a plugin module by name).

Each is the correct hand-written data parallel of ``conformance_broken_strategies``
with one defect: clipping that is not by the global norm or not capped at 1, a
hard-coded gradient divisor, a tied weight counted twice in the norm, weight
decay applied to frozen parameters, buffers dropped from the checkpoint, and
optimizer state restored only in part.
``rules_control`` is the correct one (certified on the same scenarios).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from conformance_broken_strategies import _DataParallel
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import unison
from unison import StrategySpec


class Control(_DataParallel):
    """Correct: one flattened all-reduce divided by the world size, clipping by the global norm."""


class PerBucketClip(_DataParallel):
    """Clips each of two gradient buckets by its own norm (as a sharded optimizer clipping per shard would),
    not by the global norm; it reports the global pre-clip norm. Follows pytorch/pytorch#170862
    (clip_grad_norm_ under FSDP2 clipping with the local shard's norm)."""

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if max_norm is not None:
            half = len(params) // 2
            for bucket in (params[:half], params[half:]):
                bucket_norm = torch.nn.utils.get_total_norm([p.grad for p in bucket], norm_type=2.0)
                torch.nn.utils.clip_grads_with_norm_(bucket, max_norm, bucket_norm)
        return norm


class UncappedClip(_DataParallel):
    """Multiplies the gradients by ``max_norm / norm`` at every step: below the clip value that scales them up."""

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if max_norm is not None:
            coefficient = max_norm / (norm + 1e-6)  # no clamp(max=1)
            for p in params:
                p.grad.mul_(coefficient)
        return norm


class HardCodedDivisor(_DataParallel):
    """Divides the summed gradients by 2, not by the world size, and skips the all-reduce at world size 1
    (the division stays): right at world 2 only."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._sync:
            self.average_gradients()

    def average_gradients(self) -> None:
        assert self.module is not None and self.env is not None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        if self.env.world_size > 1:
            dist.all_reduce(flat)
        flat.div_(2)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)


class HardCodedDivisorGuarded(HardCodedDivisor):
    """Divides the summed gradients by 2 and skips the all-reduce and the division at world size 1: right
    at world sizes 1 and 2, so only a world of 3 or more can see it."""

    def average_gradients(self) -> None:
        assert self.env is not None
        if self.env.world_size > 1:
            super().average_gradients()


class TiedWeightTwice(_DataParallel):
    """Computes the clipping norm over every parameter name, so a tied weight's gradient counts twice."""

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None
        named = self.module.named_parameters(remove_duplicate=False)
        norm = torch.nn.utils.get_total_norm([p.grad for _, p in named if p.grad is not None], norm_type=2.0)
        if max_norm is not None:
            params = [p for p in self.module.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm


class DecaysFrozen(_DataParallel):
    """Gives frozen parameters a zero gradient (as one flat gradient buffer with views into it would), so the
    optimizer, built over every parameter, applies weight decay to them. Follows pytorch/torchtitan#3885
    (re-registered parameters losing requires_grad=False, so frozen parameters are updated)."""

    def backward(self, loss: torch.Tensor) -> None:
        assert self.module is not None
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        super().backward(loss)


class DropsBuffersOnResume(_DataParallel):
    """Restores parameters and optimizer state on resume but drops the checkpoint's buffers: they keep the
    values the model was constructed with."""

    def load_state(self, directory: Path) -> None:
        assert self.module is not None
        constructed = {n: b.detach().clone() for n, b in self.module.named_buffers()}
        super().load_state(directory)
        with torch.no_grad():
            for n, b in self.module.named_buffers():
                b.copy_(constructed[n])


class PartialOptimizerState(_DataParallel):
    """Restores the optimizer's per-parameter state but the hyperparameters (lr, weight decay, ...) of its
    first parameter group only: the other groups keep the freshly built optimizer's."""

    def load_state(self, directory: Path) -> None:
        assert self.optimizer is not None
        fresh: list[dict[str, Any]] = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        super().load_state(directory)
        for group, hyper in zip(self.optimizer.param_groups[1:], fresh[1:]):
            group.update(hyper)


class ReducesWithinNode(_DataParallel):
    """Takes each pair of ranks for a node and averages the gradients within it only, never across nodes:
    right at world 2 (one node), two diverging halves at world 4. Follows radixark/miles#1432 (gradients
    not all-reduced across independent data-parallel replicas) and areal-project/AReaL#313 (replicated
    parameters' gradients reduced over a smaller group than the replicas)."""

    def average_gradients(self) -> None:
        assert self.module is not None
        if not hasattr(self, "_node"):
            size, rank = dist.get_world_size(), dist.get_rank()
            nodes = [dist.new_group(list(range(i, min(i + 2, size)))) for i in range(0, size, 2)]
            self._node = nodes[rank // 2]
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self._node)
        flat.div_(dist.get_world_size(self._node))
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)


BROKEN = {
    "rules_control": (Control, "correct data parallel (the control)"),
    "per_bucket_clip": (PerBucketClip, "clips each gradient bucket by its own norm"),
    "uncapped_clip": (UncappedClip, "clip coefficient not capped at 1"),
    "hard_coded_divisor": (HardCodedDivisor, "divides gradients by 2; no all-reduce at world size 1"),
    "hard_coded_divisor_guarded": (
        HardCodedDivisorGuarded,
        "divides gradients by 2; neither all-reduce nor division at world size 1",
    ),
    "tied_weight_twice": (TiedWeightTwice, "counts a tied weight twice in the clipping norm"),
    "decays_frozen": (DecaysFrozen, "hands frozen parameters to the optimizer with zero gradients"),
    "drops_buffers_on_resume": (DropsBuffersOnResume, "drops the checkpoint's buffers on resume"),
    "partial_optimizer_state": (PartialOptimizerState, "restores only the first param group's hyperparameters"),
    "reduces_within_node": (ReducesWithinNode, "averages gradients within each pair of ranks only"),
}


@unison.hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [StrategySpec(name=name, factory=cls, description=text) for name, (cls, text) in BROKEN.items()]
