"""Deliberately wrong compositions on a 2-D mesh, a plugin module the conformance tests register by name.

Each one is ``hsdp`` (FSDP2 on replicate x shard) or ``pipeline_fsdp`` (FSDP2
inside pipeline stages, dp x pp) with exactly one defect that is easy to make
when a mesh has more than one dimension; the conformance suite must refuse to
certify each one and name what it broke.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from unison import StrategySpec, hookimpl
from unison.strategies.fsdp.hsdp import HSDPOptions, HSDPStrategy
from unison.strategies.pipeline import PipelineFSDPOptions, PipelineFSDPStrategy


class NormOverWholeWorld(HSDPStrategy):
    """Computes the grad norm as ZeRO does on a flat world: each rank's squared local-shard norm all-reduced
    over *every* rank. On a 2-D mesh the replicas hold the same shards, so each is counted R times (the
    norm is sqrt(R) too large) and clipping scales by the wrong coefficient."""

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        squares = torch.zeros((), device=self.env.device)
        for g in grads:
            squares += g.to_local().float().pow(2).sum()
        dist.all_reduce(squares)  # the defect: the world, not the shard group
        norm = squares.sqrt()
        if max_norm is not None:
            coefficient = min(1.0, max_norm / (float(norm) + 1e-6))
            torch._foreach_mul_(grads, coefficient)
        return norm


class DefersReplicateOnly(HSDPStrategy):
    """``no_sync()`` defers only the replicate all-reduce (``set_requires_all_reduce(False)``): the
    reduce-scatter still runs on every micro-step, although the declaration says boundary-only on both
    dimensions. Numerically right; the suite counts the collectives."""

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        self.model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            self.model.set_requires_all_reduce(True)


class NormOverDataDimOnly(PipelineFSDPStrategy):
    """Computes the grad norm as ``fsdp`` does (the DTensor norm's ``full_tensor()``, reduced over ``dp``) and
    stops there: each stage clips by its own stage's norm, not the model's, since the squares are never
    all-reduced over ``pp``."""

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
        norm = norm.full_tensor()  # the defect: over dp only, no all-reduce over pp
        if max_norm is not None:
            coefficient = min(1.0, max_norm / (float(norm) + 1e-6))
            for p in params:
                p.grad.mul_(coefficient)
        return norm


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="hsdp_norm_over_world",
            factory=NormOverWholeWorld,
            description="hsdp whose grad norm is all-reduced over the whole world",
            options=HSDPOptions,
        ),
        StrategySpec(
            name="hsdp_defers_replicate_only",
            factory=DefersReplicateOnly,
            description="hsdp whose no_sync() defers the replicate all-reduce only",
            options=HSDPOptions,
        ),
        StrategySpec(
            name="pipeline_fsdp_norm_over_dp",
            factory=NormOverDataDimOnly,
            description="pipeline_fsdp whose grad norm is reduced over dp only (each stage's own norm)",
            options=PipelineFSDPOptions,
        ),
    ]
