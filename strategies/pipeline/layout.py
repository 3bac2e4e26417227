"""Cutting a model into pipeline chunks and placing them on ranks: plain functions.

Nothing here touches a process group or a device, so all of it is checked
before any process group starts and unit-tested on its own.

* :func:`as_layers`: the model as a chain of layers (an ``nn.Sequential``, or
  the split points a module declares with ``pipeline_layers``).
* :func:`balance_by_parameters` and :func:`split_sequential`: contiguous runs
  of those layers, one per model chunk.
* :func:`check_model`: the balance to use, or why the model cannot be cut.
* :class:`ChunkLayout`: which pipeline rank holds which chunk, and where each
  rank sits in the world (``rank = replica * stages + stage``).
* :func:`check_micro_batches`: micro-batch counts a schedule can run.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from unison.errors import ConfigurationError

Placement = Literal["single", "loop", "v"]

#: Schedule name -> (torch class name, placement of model chunks on ranks).
#: ``single``: one chunk per rank; ``loop``: rank p holds chunks p, p+S, ...;
#: ``v``: rank p holds chunks p and 2S-1-p (the V shape ZBV is built for).
SCHEDULES: dict[str, tuple[str, Placement]] = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", "v"),
}


def balance_by_parameters(sizes: Sequence[int], stages: int) -> list[int]:
    """Cut ``sizes`` (parameters per child) into ``stages`` contiguous non-empty runs.

    Minimises the largest stage's parameter count (the memory and, roughly,
    the compute of the slowest stage); ties go to the cut whose largest stage
    has the fewest children, so parameterless layers (activations) spread out
    instead of piling onto one stage. Exact dynamic programme: models have
    at most a few hundred children.
    """
    n = len(sizes)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = (math.inf, math.inf)
    # best[k][i]: (max params, max layers) cutting the first i children into k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                cand = (max(prev[0], prefix[i] - prefix[j]), max(prev[1], i - j))
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def split_sequential(model: torch.nn.Sequential, balance: Sequence[int]) -> list[torch.nn.Sequential]:
    """One ``nn.Sequential`` per stage, holding the original children under their original names."""
    items = list(model.named_children())
    stages, start = [], 0
    for count in balance:
        stages.append(torch.nn.Sequential(OrderedDict(items[start : start + count])))
        start += count
    return stages


def as_layers(model: torch.nn.Module) -> torch.nn.Sequential:
    """The model as a chain of layers: itself, or the split points it declares.

    A module that is not an ``nn.Sequential`` declares its split points with a
    ``pipeline_layers`` attribute: the names of its direct children, in the
    order its ``forward`` chains them (``forward(x) == head(body(embed(x)))``
    for ``pipeline_layers = ["embed", "body", "head"]``). The chain keeps those
    names, so state dicts and checkpoints use the module's own keys. Every
    parameter and buffer must belong to a listed child.
    """
    if isinstance(model, torch.nn.Sequential):
        return model
    names = getattr(model, "pipeline_layers", None)
    if names is None:
        raise ConfigurationError(
            "model",
            f"strategy 'pipeline' splits an nn.Sequential into stages, got {type(model).__name__}",
            "express the model as torch.nn.Sequential of its layers (each layer's output is the next one's "
            "input), or declare its split points: pipeline_layers = [names of its children in forward order]",
        )
    children = dict(model.named_children())
    unknown = [n for n in names if n not in children]
    if unknown or len(set(names)) != len(names):
        raise ConfigurationError(
            "model.pipeline_layers",
            f"{list(names)} must name distinct direct children of {type(model).__name__}; not children: {unknown}",
            f"use names from {sorted(children)}",
        )
    chain = torch.nn.Sequential(OrderedDict((n, children[n]) for n in names))
    outside = sorted(set(model.state_dict()) - set(chain.state_dict()))
    if outside:
        raise ConfigurationError(
            "model.pipeline_layers",
            f"{type(model).__name__} holds state outside its declared layers: {outside[:5]}",
            "move those parameters/buffers into a listed child, or list the child that holds them",
        )
    return chain


def check_model(model: torch.nn.Module, chunks: int, balance: list[int] | None, per_rank: int = 1) -> list[int]:
    """The balance (layers per chunk) to use, or a ConfigurationError explaining why the model cannot be cut."""
    model = as_layers(model)
    children = list(model.named_children())
    n = len(children)
    if chunks > n:
        what = (
            f"{chunks} stages"
            if per_rank == 1
            else f"{chunks} model chunks ({chunks // per_rank} stages x {per_rank} per rank)"
        )
        raise ConfigurationError(
            "strategy_options.stages",
            f"{what} need at least {chunks} layers, but the Sequential has {n}",
            f"use stages * stages_per_rank <= {n}",
        )
    if balance is None:
        sizes = [sum(p.numel() for p in child.parameters()) for _, child in children]
        balance = balance_by_parameters(sizes, chunks)
    elif sum(balance) != n:
        raise ConfigurationError(
            "strategy_options.balance",
            f"balance {balance} covers {sum(balance)} layers but the Sequential has {n}",
            f"give {chunks} positive counts that sum to {n}, or omit balance",
        )
    # A parameter shared by two stages (tied weights) would get two
    # independent copies and two optimizer states: refuse rather than diverge.
    owner: dict[int, int] = {}
    for s, stage in enumerate(split_sequential(model, balance)):
        for name, p in stage.named_parameters(remove_duplicate=False):
            if owner.setdefault(id(p), s) != s:
                raise ConfigurationError(
                    "model",
                    f"parameter {name!r} is shared between model chunk {owner[id(p)]} and chunk {s} (tied weights)",
                    "put the layers that share the parameter in the same chunk with strategy_options.balance",
                )
    return list(balance)


@dataclass(frozen=True)
class ChunkLayout:
    """Which pipeline rank holds which model chunk, and where a rank sits in the world.

    Rank ``r * stages + p`` is pipeline rank ``p`` of data-parallel replica
    ``r``. There are ``stages * per_rank`` chunks; ``placement`` says how they
    map onto the ``stages`` pipeline ranks (see :data:`SCHEDULES`).
    """

    #: Pipeline ranks per replica.
    stages: int
    #: Model chunks (virtual stages) per pipeline rank.
    per_rank: int = 1
    placement: Placement = "single"

    @property
    def chunks(self) -> int:
        """Model chunks in the whole pipeline (each one a pipeline stage of the schedule)."""
        return self.stages * self.per_rank

    def chunk_owner(self, chunk: int) -> int:
        """The pipeline rank (0..stages-1) holding model chunk ``chunk``."""
        S = self.stages
        if self.placement == "v":
            return chunk if chunk < S else 2 * S - 1 - chunk
        return chunk % S

    def chunks_of(self, stage: int) -> list[int]:
        """The chunks pipeline rank ``stage`` holds, in pipeline order."""
        return [k for k in range(self.chunks) if self.chunk_owner(k) == stage]

    def replicas(self, world_size: int) -> int:
        """Data-parallel replicas of the whole pipeline in a world of ``world_size`` ranks."""
        return max(1, world_size // self.stages)

    def stage_of(self, rank: int) -> int:
        """This rank's place in its pipeline."""
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        """This rank's data-parallel replica."""
        return rank // self.stages

    def pipeline_ranks(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s pipeline, by pipeline rank."""
        first = self.replica_of(rank) * self.stages
        return [first + s for s in range(self.stages)]


def check_micro_batches(schedule: str, layout: ChunkLayout, n: int) -> None:
    """Refuse a micro-batch count ``n`` (``accumulate_grad_batches``) the schedule cannot run."""
    S = layout.stages
    if schedule == "1f1b" and n < S:
        raise ConfigurationError(
            "accumulate_grad_batches",
            f"schedule '1f1b' needs at least as many micro-batches as stages ({S}), got accumulate_grad_batches={n}",
            f"set accumulate_grad_batches >= {S}, or use schedule='gpipe'",
        )
    if layout.placement != "single":
        # torch's multi-chunk schedules run the micro-batches in rounds of
        # n // stages and refuse a count that does not divide into them.
        rounds = max(1, n // S)
        if n % rounds:
            raise ConfigurationError(
                "accumulate_grad_batches",
                f"schedule {schedule!r} runs micro-batches in {rounds} rounds of {S}; "
                f"accumulate_grad_batches={n} is not a multiple of {rounds}",
                f"use a multiple of stages={S} micro-batches",
            )


__all__ = [
    "SCHEDULES",
    "ChunkLayout",
    "as_layers",
    "balance_by_parameters",
    "check_micro_batches",
    "check_model",
    "split_sequential",
]
