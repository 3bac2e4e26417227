"""Memory per rank by strategy, and step time against world size on a fixed global batch.

Both run in one world per size (1, 2, 4 gloo ranks): ``scaling`` times ddp and
fsdp (median of the rounds; the global batch stays the same, so each rank's
share shrinks as the world grows), and at world 4 the composed hsdp (2 replicas
x 2 shards), fsdp_tp (2 dp x 2 tp) and pipeline_fsdp (2 replicas x 2 stages)
beside them; ``memory`` trains each strategy briefly and
reads :meth:`Strategy.memory_footprint` (bytes this rank holds for parameters,
gradients and optimizer state, counted from the tensors the backend really
holds) after the last step, with the process's resident set size.

The ZeRO paper (Rajbhandari et al., 2020, Fig. 1) counts ``2Ψ + 2Ψ + KΨ``
bytes for Ψ parameters in mixed precision with Adam (K = 12: fp32 master,
momentum, variance). These runs are fp32, so the same formulas are written
with 4-byte parameters and gradients and K = 8 (momentum and variance; the
fp32 parameters are the masters): DDP ``4Ψ + 4Ψ + 8Ψ``, ZeRO-1 (optimizer
state) ``4Ψ + 4Ψ + 8Ψ/N``, ZeRO-2 (+ gradients) ``4Ψ + 4Ψ/N + 8Ψ/N``, ZeRO-3
and FSDP (+ parameters) ``(4 + 4 + 8)Ψ/N``. DeepSpeed keeps a separate fp32
master partition even when the parameters are fp32, so its stages are
compared with the paper's K = 12 (master, momentum, variance). Per mesh
dimension: hsdp shards over its shard group of S ranks and replicates over the
rest, ``(4 + 4 + 8)Ψ/S``; fsdp_tp splits the planned parameters Ψ_tp over T
tp ranks and shards everything over D = N/T dp ranks, ``(4 + 4 + 8)(Ψ_tp/(D·T)
+ Ψ_rep/D)`` (Ψ_rep: the parameters its plan leaves whole, here row-wise biases);
pipeline_fsdp holds one stage of 2 (rank 0: stage 0, Ψ_0 of the Ψ parameters)
sharded over D = N/2 replicas, ``(4 + 4 + 8)Ψ_0/D``.
"""

from __future__ import annotations

import resource
import statistics
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.workload import Workload, run_unison, steady_step_time

SCALING = ("ddp", "fsdp")
#: Composed strategies, timed where their 2x2 mesh exists (world 4), beside fsdp.
COMPOSED_SCALING = ("hsdp", "fsdp_tp", "pipeline_fsdp")
MEMORY = ("ddp", "torch_zero", "zero1", "zero2", "zero3", "fsdp", "hsdp", "fsdp_tp", "pipeline_fsdp")

#: (parameters, gradients, optimizer state) bytes per parameter, as functions of N, fp32 + Adam.
ZERO_FORMULA = {
    "ddp": (lambda n: 4.0, lambda n: 4.0, lambda n: 8.0),
    "torch_zero": (lambda n: 4.0, lambda n: 4.0, lambda n: 8.0 / n),
    # DeepSpeed keeps a separate fp32 master partition even for fp32 parameters: the paper's K = 12.
    "zero1": (lambda n: 4.0, lambda n: 4.0, lambda n: 12.0 / n),
    "zero2": (lambda n: 4.0, lambda n: 4.0 / n, lambda n: 12.0 / n),
    "zero3": (lambda n: 4.0 / n, lambda n: 4.0 / n, lambda n: 12.0 / n),
    "fsdp": (lambda n: 4.0 / n, lambda n: 4.0 / n, lambda n: 8.0 / n),
    # hsdp shards over its shard group only (shard_size, default 2; memory runs at world 2 and 4), S = min(N, 2).
    "hsdp": (lambda n: 4.0 / min(n, 2), lambda n: 4.0 / min(n, 2), lambda n: 8.0 / min(n, 2)),
}
ZERO_FORMULA_TEXT = {
    "ddp": "4Ψ + 4Ψ + 8Ψ",
    "torch_zero": "4Ψ + 4Ψ + 8Ψ/N",
    "zero1": "4Ψ + 4Ψ + 12Ψ/N",
    "zero2": "4Ψ + 4Ψ/N + 12Ψ/N",
    "zero3": "(4+4+12)Ψ/N",
    "fsdp": "(4+4+8)Ψ/N",
    "hsdp": "(4+4+8)Ψ/S, S = shard_size = 2",
    "fsdp_tp": "(4+4+8)(Ψ_tp/(D·T) + Ψ_rep/D), T = tp_size = 2, D = N/T",
    "pipeline_fsdp": "(4+4+8)Ψ_0/D, Ψ_0 = stage 0's parameters, D = N/2",
}
#: fsdp_tp: tp_size (the strategy's default), and the parameters its plan splits over tp.
TP_SIZE = 2


def tp_split(model: torch.nn.Module) -> int:
    """Parameters the model's ``tp_plan`` splits over tp: every planned weight, and colwise biases.

    A rowwise layer's bias is added after the all-reduce of its output: it stays whole on every tp rank.
    """
    plan = getattr(model, "tp_plan", {})
    modules = dict(model.named_modules())
    split = 0
    for name, style in plan.items():
        layer = modules[name]
        split += layer.weight.numel()
        if style == "colwise" and layer.bias is not None:
            split += layer.bias.numel()
    return split


def memory_formula(strategy: str, n: int, w: Workload) -> tuple[float, float, float]:
    """Bytes per rank for parameters, gradients and optimizer state by the formula of ``strategy`` at world ``n``."""
    psi = w.parameters()
    if strategy == "fsdp_tp":
        tp, dp = TP_SIZE, n // TP_SIZE
        split = tp_split(w.model())
        effective = split / (dp * tp) + (psi - split) / dp
        return 4.0 * effective, 4.0 * effective, 8.0 * effective
    if strategy == "pipeline_fsdp":
        from unison.strategies.pipeline.layout import check_model

        # Rank 0 holds stage 0 (of 2, cut by parameter count as the strategy cuts it), sharded over D replicas.
        model = w.model()
        first = check_model(model, 2, None)[0]
        stage0 = sum(p.numel() for layer in list(model.children())[:first] for p in layer.parameters())
        per_rank = stage0 / (n // 2)
        return 4.0 * per_rank, 4.0 * per_rank, 8.0 * per_rank
    fp, fg, fo = ZERO_FORMULA[strategy]
    return fp(n) * psi, fg(n) * psi, fo(n) * psi


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / (1 << 20)


class _Footprint:
    """Reads the strategy's footprint and the RSS after the last step (a unison plugin)."""

    def __init__(self) -> None:
        self.footprint: dict[str, int] = {}
        self.rss_mib = 0.0

    def plugin(self) -> Any:
        import unison

        outer = self

        class Reader:
            @unison.hookimpl
            def unison_on_train_step_end(self, trainer: Any, step: int) -> None:
                outer.rss_mib = max(outer.rss_mib, _rss_mib())
                if step + 1 == trainer.settings.max_steps:
                    outer.footprint = trainer.strategy.memory_footprint()

        return Reader()


def world_memory_scaling(w: Workload, rounds: int, memory: bool) -> dict[str, Any]:
    """Run on every rank of a world of any size."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    out: dict[str, Any] = {"world": world, "scaling": {}, "memory": {}}
    for strategy in SCALING + (COMPOSED_SCALING if world == 4 else ()):
        times = []
        for _ in range(rounds):
            if dist.is_initialized():
                dist.barrier()
            times.append(steady_step_time(run_unison(w, strategy)["stamps"], w.warmup))
        out["scaling"][strategy] = {
            "median_ms": statistics.median(times) * 1e3,
            "spread": (max(times) - min(times)) / statistics.median(times),
        }
    if memory:
        short = Workload(**{**w.__dict__, "steps": 3, "warmup": 1})
        for strategy in MEMORY:
            reader = _Footprint()
            rss_before = _rss_mib()
            run_unison(short, strategy, callbacks=(reader.plugin(),))
            out["memory"][strategy] = {**reader.footprint, "rss_mib": reader.rss_mib, "rss_before_mib": rss_before}
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out
