"""``pipeline``: pipeline parallelism with ``torch.distributed.pipelining``.

The model must be an ``nn.Sequential``, or a module that declares its split
points with ``pipeline_layers`` (see :func:`as_layers`). Its children are cut into
``stages * stages_per_rank`` contiguous *model chunks*, each one a
:class:`~torch.distributed.pipelining.PipelineStage`. Rank ``r * stages + p``
is pipeline rank ``p`` of data-parallel replica ``r`` (``world_size = stages *
replicas``). GPipe and 1F1B put one chunk on each pipeline rank; the
interleaved, looped-BFS and zero-bubble schedules put ``stages_per_rank``
chunks on each (looped placement: rank ``p`` holds chunks ``p, p + stages,
...``; ZBV's V placement: chunks ``p`` and ``2 * stages - 1 - p``). One
optimizer step is one run of the schedule over the step's
``accumulate_grad_batches`` micro-batches, so the schedule, not the trainer,
owns accumulation.

On each rank :attr:`Strategy.module` (and so ``Trainer.model``) is an
``nn.Sequential`` of the layers this rank trains, under their original names.

Decisions, and why:

* **Manual split, no tracing.** Each chunk is built from the Sequential's own
  children and wrapped in :class:`~torch.distributed.pipelining.PipelineStage`.
  Tracing (``pipeline()``/``SplitPoint``) would rename parameters and fail on
  models torch.export cannot capture; a Sequential already says where the cuts
  may go.
* **Original names everywhere.** A chunk (and a rank's module) is an
  ``nn.Sequential`` whose children keep their original names (``"2"``,
  ``"3"``, ``"4"``), so its ``state_dict()`` keys *are* the full model's keys
  (``"2.weight"``). That one choice makes ``full_state_dict`` a plain merge
  and makes the checkpoint the same DCP layout ``ddp``/``single`` write
  (``model.<name>``, ``optim.state.<name>.<key>``, ``optim.param_groups.<i>.*``
  listing every parameter of the model): a checkpoint from any of them
  resumes under any other, at any world size and any cut.
* **Mean over micro-batches inside the schedule loss.** The schedule backpropagates
  ``loss / n`` (with ``scale_grads=False``), exactly what the trainer does for
  trainer-owned accumulation, so gradients equal the single-process
  reference's up to float round-off. Rescaling gradients after the fact would
  add a second rounding.
* **Data parallelism by hand.** After the schedule, each stage all-reduces its
  gradients (mean) over the replicas of the same stage: one collective per
  optimizer step. Wrapping stages in DDP would fire DDP hooks inside the
  schedule's own backward calls, which the pipelining runtime drives outside
  ``loss.backward()``.
* **Global clipping.** Each rank holds a slice of the model, so the global
  norm is the square root of the squared per-rank norms all-reduced over the
  pipeline; every rank clips by that same number.
* **Losses on every rank.** Only the last chunk sees the loss; its undivided
  per-micro-batch losses are broadcast over the pipeline so that the trainer
  logs the same numbers on every rank.
* **Precision inside the schedule.** Each chunk enters the trainer's
  ``forward_context`` (autocast) around its own forward, and the last chunk
  around the loss; backward runs outside it, as for every other backend. For
  fp16 the GradScaler's overflow flag is all-reduced over the world, because
  each rank only sees its own gradients.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from unison.errors import ConfigurationError
from unison.ownership import (
    AccumulationOwner,
    Feature,
    GradAccumulation,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
    StateDictDeclaration,
    StateDictKind,
    WorldSizes,
)
from unison.plugin import hookimpl
from unison.precision import Precision
from unison.registry import StrategySpec, missing_modules
from unison.state import canonical
from unison.env import DistEnv
from unison.strategy import LossFn, OptimizerFactory, Strategy

#: Schedule name -> (torch class name, placement of model chunks on ranks).
#: ``single``: one chunk per rank; ``loop``: rank p holds chunks p, p+S, ...;
#: ``v``: rank p holds chunks p and 2S-1-p (the V shape ZBV is built for).
SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", "v"),
}


class PipelineOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    stages: int = pydantic.Field(2, ge=1)
    """Pipeline ranks per replica; the world size must be a multiple of it."""
    schedule: Literal[
        "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble"
    ] = "gpipe"
    """``gpipe`` (all forwards, then all backwards), ``1f1b`` (one forward, one backward in steady
    state), or a schedule with several model chunks per rank: ``interleaved_1f1b``, ``looped_bfs``,
    ``interleaved_zero_bubble``, ``zbv_zero_bubble``."""
    stages_per_rank: int | None = pydantic.Field(None, ge=1)
    """Model chunks (virtual stages) per rank; ``None``: 1 for gpipe/1f1b, 2 otherwise."""
    balance: list[int] | None = None
    """Children of the Sequential per model chunk (``stages * stages_per_rank`` counts);
    ``None`` balances by parameter count."""


# --------------------------------------------------------------------------- #
# Splitting (plain functions: no process group, testable on their own)
# --------------------------------------------------------------------------- #
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


def _check_model(model: torch.nn.Module, stages: int, balance: list[int] | None, per_rank: int = 1) -> list[int]:
    """The balance to use, or a ConfigurationError explaining why the model cannot be split."""
    model = as_layers(model)
    children = list(model.named_children())
    n = len(children)
    if stages > n:
        what = f"{stages} stages" if per_rank == 1 else f"{stages} model chunks ({stages // per_rank} stages x {per_rank} per rank)"
        raise ConfigurationError(
            "strategy_options.stages",
            f"{what} need at least {stages} layers, but the Sequential has {n}",
            f"use stages * stages_per_rank <= {n}",
        )
    if balance is None:
        sizes = [sum(p.numel() for p in child.parameters()) for _, child in children]
        balance = balance_by_parameters(sizes, stages)
    elif sum(balance) != n:
        raise ConfigurationError(
            "strategy_options.balance",
            f"balance {balance} covers {sum(balance)} layers but the Sequential has {n}",
            f"give {stages} positive counts that sum to {n}, or omit balance",
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


# --------------------------------------------------------------------------- #
# The strategy
# --------------------------------------------------------------------------- #
_PIPELINE_STATE = StateDictDeclaration(
    kind=StateDictKind.SHARDED,
    format="torch.distributed.checkpoint (DCP), keys = the Sequential's own parameter names, optimizer "
    "state keyed by name (the layout ddp/single write); each rank writes its own layers",
    reshardable=True,
    canonical_export="each rank's state_dict (original names) all-gathered over the pipeline, fp32, on CPU, on every rank",
)


#: What a pipeline cannot take, and why (shown by ``unison describe``; refused before training).
_PIPELINE_REFUSALS = {
    Feature.TRAINING_STEP: (
        "each rank holds only some stages of the model, so no rank can call training_step(model, batch) on the "
        "whole model; the last stage computes loss_fn(outputs, targets). Pass loss_fn=... with (inputs, targets) "
        "batches, or train this model with a data-parallel strategy (ddp, fsdp, zero*)"
    ),
    Feature.ARBITRARY_MODULE: (
        "the model is cut into contiguous runs of its layers: pass an nn.Sequential, or declare the split points "
        "with pipeline_layers = [child names in forward order]"
    ),
    Feature.TIED_WEIGHTS: (
        "a parameter shared by layers that land in different model chunks would get two independent copies; "
        "ties within one chunk are fine (choose the cut with strategy_options.balance)"
    ),
}


def _buffer_keeping_stage(pipelining: Any) -> type:
    """``PipelineStage`` whose one-time shape inference leaves the stage's buffers as they were.

    Before its first step torch runs each stage's forward once, in training
    mode, to infer the shapes it sends (``_forward_metadata_inference``: on the
    first micro-batch at stage 0, on uninitialised tensors of the right shape
    at the others). A forward that updates buffers (BatchNorm's running
    statistics and ``num_batches_tracked``) would keep that extra update, taken
    from garbage memory or from the first micro-batch twice, which no other
    backend makes; the buffers are therefore restored after it. Restored by
    putting the saved copies in place of the buffer tensors, not by copying
    into them: torch backpropagates through that inference graph next (to
    infer gradient shapes), and an in-place write to a tensor it saved would
    fail its version check.
    """
    base = pipelining.PipelineStage
    if not hasattr(base, "_forward_metadata_inference"):  # the torch pinned in pyproject has it
        raise RuntimeError("torch.distributed.pipelining.PipelineStage has no _forward_metadata_inference; "
                           "strategy 'pipeline' needs torch 2.13")

    class BufferKeepingStage(base):  # type: ignore[misc,valid-type]  # a class from the lazy import
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            saved = [(m, name, b.detach().clone()) for m in self.submod.modules()
                     for name, b in m._buffers.items() if b is not None]
            try:
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                for module, name, value in saved:
                    module._buffers[name] = value

    return BufferKeepingStage


class _StageForward(torch.nn.Module):
    """Runs one stage inside the trainer's precision context.

    The trainer applies autocast around ``forward`` for other backends; here
    each stage's forward runs inside the schedule, so the stage enters the
    context itself. Backward stays outside autocast (as with the trainer).
    """

    def __init__(self, stage: torch.nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.precision: Precision = Precision()

    def forward(self, x: Any) -> Any:
        with self.precision.forward_context():
            return self.stage(x)


class PipelineStrategy(Strategy):
    """Schedule-owned accumulation over model chunks of an ``nn.Sequential`` (see the module doc).

    Construction validates the options alone; :meth:`validate` checks them
    against the world size and micro-batch count, :meth:`validate_model`
    against the model, both before any process group starts.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = PipelineOptions(**options)
        o = self.options
        self.placement = SCHEDULES[o.schedule][1]
        self.per_rank = o.stages_per_rank or (1 if self.placement == "single" else 2)
        if self.placement == "single" and self.per_rank != 1:
            raise ConfigurationError(
                "strategy_options.stages_per_rank",
                f"schedule {o.schedule!r} runs one model chunk per rank, got stages_per_rank={self.per_rank}",
                "omit stages_per_rank, or pick interleaved_1f1b / looped_bfs / interleaved_zero_bubble",
            )
        if self.placement == "v" and self.per_rank != 2:
            raise ConfigurationError(
                "strategy_options.stages_per_rank",
                f"schedule 'zbv_zero_bubble' places exactly 2 model chunks per rank, got {self.per_rank}",
                "omit stages_per_rank or set it to 2",
            )
        #: Model chunks in the whole pipeline (each one a PipelineStage).
        self.chunks = o.stages * self.per_rank
        if o.balance is not None and (len(o.balance) != self.chunks or any(c < 1 for c in o.balance)):
            raise ConfigurationError(
                "strategy_options.balance",
                f"balance {o.balance} must hold {self.chunks} positive layer counts (one per model chunk: "
                f"stages={o.stages} x stages_per_rank={self.per_rank})",
                f"give {self.chunks} counts >= 1, or omit balance to balance by parameter count",
            )
        self._loss: tuple[LossFn, Precision, int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._pp_group: Any = None
        self._dp_group: Any = None

    # -- declaration ------------------------------------------------------- #
    @property
    def ownership(self) -> Ownership:
        o = self.options
        return Ownership(
            grad_accumulation=GradAccumulation(
                AccumulationOwner.SCHEDULE,
                f"torch.distributed.pipelining {SCHEDULES[o.schedule][0]} ({self.per_rank} model chunk(s) per rank) with "
                "n_microbatches = accumulate_grad_batches; the schedule backpropagates loss / n (scale_grads=False), "
                "then each rank all-reduces (mean) its gradients over data-parallel replicas once per step",
            ),
            precision={
                "32-true": PrecisionSupport(PrecisionOwner.TRAINER, "fp32 parameters, activations and compute"),
                "bf16-mixed": PrecisionSupport(
                    PrecisionOwner.TRAINER,
                    "the trainer's torch.autocast(bfloat16), entered by each stage around its forward and around "
                    "the loss on the last stage; backward runs outside autocast",
                ),
                "bf16-true": PrecisionSupport(
                    PrecisionOwner.TRAINER, "module.to(bfloat16) and bf16 inputs by the trainer; bf16 activations cross stages"
                ),
                "16-mixed": PrecisionSupport(
                    PrecisionOwner.TRAINER,
                    "torch.autocast(float16) per stage + a GradScaler whose overflow flag is all-reduced over the "
                    "world, so every stage skips the same steps and keeps the same scale",
                ),
            },
            state_dict=_PIPELINE_STATE,
            refuses=_PIPELINE_REFUSALS,
            world_sizes=WorldSizes(minimum=o.stages, multiple_of=o.stages,
                                   reason=f"each data-parallel replica is a pipeline of stages={o.stages} ranks"),
            notes=(
                "model chunks are contiguous runs of the Sequential's children (or of the declared pipeline_layers)",
                "inputs, targets and the activations between chunks must be single tensors",
                (
                    "interleaved and zero-bubble schedules hold stages_per_rank model chunks per rank; ZBV uses the "
                    "V placement (rank p holds chunks p and 2*stages-1-p), the others the looped one"
                ),
                "validation runs a plain forward through the chunks (no schedule), one batch at a time",
            ),
        )

    def data_parallel_size(self, world_size: int) -> int:
        return max(1, world_size // self.options.stages)

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        return rank // self.options.stages

    def data_parallel_group(self) -> Any:
        return self._dp_group

    def validate(self, settings: Any, world_size: int) -> None:
        # The world size is checked against the declaration (world_sizes) by the trainer.
        o = self.options
        n = settings.accumulate_grad_batches
        if o.schedule == "1f1b" and n < o.stages:
            raise ConfigurationError(
                "accumulate_grad_batches",
                f"schedule '1f1b' needs at least as many micro-batches as stages ({o.stages}), "
                f"got accumulate_grad_batches={n}",
                f"set accumulate_grad_batches >= {o.stages}, or use schedule='gpipe'",
            )
        if self.placement != "single":
            # torch's multi-chunk schedules run the micro-batches in rounds of
            # n // stages and refuse a count that does not divide into them.
            rounds = max(1, n // o.stages)
            if n % rounds:
                raise ConfigurationError(
                    "accumulate_grad_batches",
                    f"schedule {o.schedule!r} runs micro-batches in {rounds} rounds of {o.stages}; "
                    f"accumulate_grad_batches={n} is not a multiple of {rounds}",
                    f"use a multiple of stages={o.stages} micro-batches",
                )

    def validate_model(self, model: torch.nn.Module, settings: Any) -> None:
        _check_model(model, self.chunks, self.options.balance, self.per_rank)

    # -- setup ------------------------------------------------------------- #
    def _make_groups(self, env: DistEnv) -> None:
        """Pipeline and data-parallel groups; every rank creates every group, in one order.

        Made afresh at every setup: a group does not outlive the process group
        the trainer may destroy at the end of ``fit``.
        """
        S = self.options.stages
        R = env.world_size // S
        self._pp_group = self._dp_group = None
        for r in range(R):
            group = dist.new_group([r * S + s for s in range(S)])
            if env.rank // S == r:
                self._pp_group = group
        for s in range(S):
            group = dist.new_group([r * S + s for r in range(R)])
            if env.rank % S == s:
                self._dp_group = group

    def chunk_owner(self, chunk: int) -> int:
        """The pipeline rank (0..stages-1) holding model chunk ``chunk``."""
        S = self.options.stages
        if self.placement == "v":
            return chunk if chunk < S else 2 * S - 1 - chunk
        return chunk % S

    def setup(self, module: torch.nn.Module, make_optimizer: OptimizerFactory, *, precision: Any, settings: Any) -> None:
        env = self.env
        assert env is not None
        from torch.distributed import pipelining

        o = self.options
        self._make_groups(env)
        balance = _check_model(module, self.chunks, o.balance, self.per_rank)
        module = as_layers(module)
        self.stage_index = env.rank % o.stages  # this rank's place in its pipeline
        self.replicas = env.world_size // o.stages
        self._pp_ranks = [(env.rank // o.stages) * o.stages + s for s in range(o.stages)]
        chunks = split_sequential(module, balance)
        self._mine = [k for k in range(self.chunks) if self.chunk_owner(k) == self.stage_index]
        # Everything this rank trains, under the original names (what the
        # optimizer, clipping, state dicts and train()/eval() see).
        self.module = torch.nn.Sequential(
            OrderedDict((name, child) for k in self._mine for name, child in chunks[k].named_children())
        ).to(env.device)
        self._chunk_modules = {k: chunks[k] for k in self._mine}
        self._full_keys = list(module.state_dict().keys())
        self._param_order = {name: i for i, (name, _) in enumerate(module.named_parameters())}
        self._runners = [_StageForward(chunks[k]) for k in self._mine]
        self._n = settings.accumulate_grad_batches
        stage_class = _buffer_keeping_stage(pipelining)
        self.pipe_stages = [
            stage_class(runner, k, self.chunks, env.device, group=self._pp_group)
            for k, runner in zip(self._mine, self._runners)
        ]
        schedule_cls = getattr(pipelining, SCHEDULES[o.schedule][0])
        # scale_grads=False: the mean over micro-batches is taken in the loss
        # (loss / n), as the trainer does for every other backend.
        self.schedule = schedule_cls(
            self.pipe_stages[0] if self.placement == "single" else self.pipe_stages,
            self._n, loss_fn=self._schedule_loss, scale_grads=False,
        )
        self.model = self.schedule
        self.optimizer = make_optimizer(self.module.parameters())

    @property
    def is_first(self) -> bool:
        """Holds the first model chunk (feeds the inputs)."""
        return 0 in self._mine

    @property
    def is_last(self) -> bool:
        """Holds the last model chunk (computes the loss)."""
        return self.chunks - 1 in self._mine

    @property
    def _last_rank(self) -> int:
        return self._pp_ranks[self.chunk_owner(self.chunks - 1)]

    # -- hot path ---------------------------------------------------------- #
    def forward(self, inputs: Any) -> Any:
        raise NotImplementedError(
            "strategy 'pipeline' holds one stage per rank and owns the schedule: the trainer calls forward_backward()"
        )

    def _schedule_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss is not None
        loss_fn, precision, n, record = self._loss
        with precision.forward_context():
            loss = loss_fn(output, target)
        # The one place the loss is divided for accumulation (see module doc).
        scaled = precision.scale_loss(loss / n)
        # The stage's one-time shape inference also calls this loss (on empty
        # tensors); only the losses the schedule reports back are real, so
        # they are matched by identity after the step.
        record.append((scaled, loss.detach()))
        return scaled

    def forward_backward(self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, precision: Precision) -> list[torch.Tensor]:
        assert self.env is not None
        n = len(micro_batches)
        if n != self._n:
            raise RuntimeError(f"pipeline schedule was built for {self._n} micro-batches, got {n}")
        record: list[tuple[torch.Tensor, torch.Tensor]] = []
        reported: list[torch.Tensor] = []
        self._loss = (loss_fn, precision, n, record)
        for runner in self._runners:
            runner.precision = precision
        device = self.env.device
        try:
            # step() re-splits a whole batch along dim 0; equal micro-batches
            # concatenated and re-split are exactly the trainer's micro-batches.
            if self.is_first:
                inputs = torch.cat([_tensor(precision.convert_input(x), "inputs").to(device) for x, _ in micro_batches])
            if self.is_last:
                target = torch.cat([_tensor(y, "targets").to(device) for _, y in micro_batches])
            if self.is_first and self.is_last:
                self.schedule.step(inputs, target=target, losses=reported, return_outputs=False)
            elif self.is_first:
                self.schedule.step(inputs, return_outputs=False)
            elif self.is_last:
                self.schedule.step(target=target, losses=reported, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        finally:
            self._loss = None
            for runner in self._runners:
                runner.precision = Precision()
        self._all_reduce_grads()
        # Every rank of the pipeline returns the last stage's micro-batch losses,
        # so the trainer's reduce_mean over replicas is the same everywhere.
        if self.is_last:
            undivided = [next(loss for scaled, loss in record if scaled is r) for r in reported]
            losses = torch.stack(undivided).float()
        else:
            losses = torch.zeros(n, dtype=torch.float32, device=device)
        losses = losses.to(device)
        if self.options.stages > 1:
            dist.broadcast(losses, src=self._last_rank, group=self._pp_group)
        return list(losses.unbind())

    def _all_reduce_grads(self) -> None:
        """Mean of each stage's gradients over its data-parallel replicas (one flat all-reduce)."""
        if self.replicas == 1:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        flat.div_(self.replicas)
        dist.all_reduce(flat, group=self._dp_group)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None and self.env is not None
        params = [p for p in self.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        local = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True) if grads else torch.zeros(())
        squared = (local.float() ** 2).to(self.env.device).reshape(1)
        if self.options.stages > 1:
            # Gradients are equal across replicas, so the pipeline holds the whole model.
            dist.all_reduce(squared, group=self._pp_group)
        norm = squared.sqrt().reshape(())
        if max_norm is not None and params:
            # clip_grads_with_norm_ scales p.grad of the parameters it is given.
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.to(grads[0].device), foreach=True)
        return norm

    def make_grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        return _WorldGradScaler(device.type)

    @torch.no_grad()
    def eval_loss(self, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """Plain forward through the model chunks, one after the other.

        Validation batches differ in size from training micro-batches, and the
        schedule's communication buffers are sized for the latter, so the
        activations are passed point to point here instead. Every rank walks
        the chunks in order, so each send meets its receive.
        """
        assert self.env is not None and self.module is not None
        device = self.env.device
        x: Any = None
        for k in range(self.chunks):
            owner = self.chunk_owner(k)
            if owner != self.stage_index:
                continue
            if k == 0:
                x = _tensor(inputs, "inputs").to(device)
            elif self.chunk_owner(k - 1) != owner:
                x = _recv_tensor(self._pp_ranks[self.chunk_owner(k - 1)], device)
            x = self._chunk_modules[k](x)
            if k + 1 < self.chunks and self.chunk_owner(k + 1) != owner:
                _send_tensor(_tensor(x, "stage output"), self._pp_ranks[self.chunk_owner(k + 1)])
        if self.is_last:
            loss = loss_fn(x, targets.to(device) if isinstance(targets, torch.Tensor) else targets).float()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)
        if self.options.stages > 1:
            loss = loss.reshape(1).contiguous()
            dist.broadcast(loss, src=self._last_rank, group=self._pp_group)
        return loss.reshape(())

    # -- state ------------------------------------------------------------- #
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        mine = canonical(self.module.state_dict())
        if self.options.stages == 1:
            return mine
        parts: list[Any] = [None] * self.options.stages
        dist.all_gather_object(parts, mine, group=self._pp_group)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        # The Sequential's own order (ranks may hold non-adjacent chunks).
        return {k: merged[k] for k in self._full_keys if k in merged} | merged

    def _optim_state(self) -> dict[str, Any]:
        # Keyed by the stage's parameter names, which are the model's names.
        return get_optimizer_state_dict(self.module, self.optimizer, options=StateDictOptions())

    def save_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None
        optim = self._optim_state()
        # ddp/single list every parameter of the model in each param group; so
        # do we (the same on every rank), so that they can load this file.
        if self.options.stages > 1:
            self._gather_group_names(optim)
        state = {"model": dict(self.module.state_dict()), "optim": optim}
        dcp.save(state, checkpoint_id=str(directory))

    def _gather_group_names(self, optim: dict[str, Any]) -> None:
        """With several param groups, each group's full name list is the union over stages."""
        local = [list(g["params"]) for g in optim["param_groups"]]
        parts: list[Any] = [None] * self.options.stages
        dist.all_gather_object(parts, local, group=self._pp_group)
        for i, group in enumerate(optim["param_groups"]):
            # In the model's own parameter order, as ddp/single list them.
            group["params"] = sorted((n for part in parts for n in part[i]), key=self._param_order.__getitem__)

    def load_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None
        optim = self._optim_state()  # builds the optimizer state to load into
        names = [list(g["params"]) for g in optim["param_groups"]]
        # Request only this stage's entries; param_groups' name lists in the
        # file span the whole model, so they are not read back.
        request = {
            "model": dict(self.module.state_dict()),
            "optim": {
                "state": optim["state"],
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]],
            },
        }
        dcp.load(request, checkpoint_id=str(directory))
        self.module.load_state_dict(request["model"])
        loaded = {
            "state": request["optim"]["state"],
            "param_groups": [{**g, "params": n} for g, n in zip(request["optim"]["param_groups"], names)],
        }
        set_optimizer_state_dict(self.module, self.optimizer, loaded, options=StateDictOptions())

    def teardown(self) -> None:
        super().teardown()
        self.schedule = None
        self.pipe_stages = self._runners = []


# --------------------------------------------------------------------------- #
# deepspeed_pipeline
# --------------------------------------------------------------------------- #
class DeepSpeedPipelineOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    stages: int = pydantic.Field(2, ge=1)
    """Pipeline stages per replica; the world size must be a multiple of it."""
    partition_method: str = "parameters"
    """DeepSpeed's own layer partitioning: ``parameters``, ``uniform`` or ``type:REGEX``."""


class DeepSpeedPipelineStrategy(PipelineStrategy):
    """DeepSpeed's ``PipelineModule`` and ``PipelineEngine`` (fp32 only).

    Decisions, and why:

    * The engine runs its own ``TrainSchedule`` (1F1B) for the forwards,
      backwards and the data-parallel gradient all-reduce (``ReduceGrads``),
      with ``gradient_accumulation_steps = accumulate_grad_batches`` so its
      backward divides each micro-batch loss by that count: gradients are the
      mean over micro-batches, as for every backend.
    * Its ``OptimizerStep`` instruction is left out of the schedule.
      ``train_batch()`` would clip, step and zero inside one call; the trainer
      must see the global norm, fire ``before_optimizer_step`` and step the
      client optimizer and scheduler itself, exactly once per step. Clipping,
      losses on every rank, validation and checkpoints are the ``pipeline``
      strategy's, because a ``PipelineModule`` registers each layer under its
      index in the layer list, that is, under the Sequential's own names.
    * Ranks are laid out as for ``pipeline`` (``rank = replica * stages +
      stage``): the topology is ``ProcessTopology(axes=["data", "pipe"])``.
    * Only fp32: DeepSpeed applies bf16/fp16 through its own optimizer
      wrappers, whose step is the instruction this strategy leaves out.
    """

    def __init__(self, **options: Any) -> None:
        Strategy.__init__(self)
        self.options = DeepSpeedPipelineOptions(**options)  # type: ignore[assignment]
        self.placement, self.per_rank, self.chunks = "single", 1, self.options.stages
        self._loss = None
        self._pp_group = self._dp_group = None
        self.engine: Any = None

    @property
    def ownership(self) -> Ownership:
        unsupported = (
            "DeepSpeed's pipeline engine applies {0} through its own optimizer wrapper, which steps inside the "
            "OptimizerStep instruction that deepspeed_pipeline leaves to the trainer; use strategy 'pipeline' for {0}"
        )
        return Ownership(
            grad_accumulation=GradAccumulation(
                AccumulationOwner.SCHEDULE,
                "DeepSpeed PipelineEngine TrainSchedule with gradient_accumulation_steps = accumulate_grad_batches "
                "(the engine divides each micro-batch loss by it) and its ReduceGrads data-parallel all-reduce; "
                "the OptimizerStep instruction is left out: the trainer clips (global norm over the pipeline) "
                "and steps the client optimizer",
            ),
            precision={
                "32-true": PrecisionSupport(PrecisionOwner.TRAINER, "fp32 parameters, activations and compute"),
                "bf16-mixed": PrecisionSupport.unsupported(unsupported.format("bf16")),
                "bf16-true": PrecisionSupport.unsupported(unsupported.format("bf16")),
                "16-mixed": PrecisionSupport.unsupported(unsupported.format("fp16 loss scaling")),
            },
            state_dict=_PIPELINE_STATE,
            refuses={
                **_PIPELINE_REFUSALS,
                Feature.ARBITRARY_MODULE: "DeepSpeed's PipelineModule takes a list of layers: pass an nn.Sequential "
                "(strategy 'pipeline' also accepts a module declaring pipeline_layers)",
            },
            world_sizes=WorldSizes(minimum=self.options.stages, multiple_of=self.options.stages,
                                   reason=f"each data-parallel replica is a pipeline of stages={self.options.stages} ranks"),
            notes=(
                "DeepSpeed partitions the Sequential's children (partition_method)",
                "inputs, targets and the activations between stages must be single tensors",
                "validation runs a plain forward through the stages (no schedule), one batch at a time",
            ),
        )

    def validate(self, settings: Any, world_size: int) -> None:
        pass  # the world size is checked against the declaration (world_sizes) by the trainer

    def validate_model(self, model: torch.nn.Module, settings: Any) -> None:
        if not isinstance(model, torch.nn.Sequential):
            # PipelineModule takes a list of layers; declared split points
            # (pipeline_layers) are supported by `pipeline` only.
            raise ConfigurationError(
                "model",
                f"strategy 'deepspeed_pipeline' partitions an nn.Sequential's children, got {type(model).__name__}",
                "express the model as torch.nn.Sequential of its layers, or use strategy 'pipeline', which also "
                "accepts a module declaring pipeline_layers",
            )
        _check_model(model, self.options.stages, None)

    def setup(self, module: torch.nn.Module, make_optimizer: OptimizerFactory, *, precision: Any, settings: Any) -> None:
        env = self.env
        assert env is not None
        import os

        if env.device.type == "cpu":
            # DeepSpeed picks its accelerator at first import.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.topology import ProcessTopology

        S = self.options.stages
        R = env.world_size // S
        # PipelineModule needs deepspeed.comm before the engine exists; it
        # wraps the trainer's process group.
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        module = module.to(env.device)
        self._full_keys = list(module.state_dict().keys())
        self._param_order = {name: i for i, (name, _) in enumerate(module.named_parameters())}
        pipe_module = PipelineModule(
            layers=list(module.children()),
            loss_fn=self._ds_loss,
            topology=ProcessTopology(axes=["data", "pipe"], dims=[R, S]),
            partition_method=self.options.partition_method,
        )
        self.optimizer = make_optimizer(pipe_module.parameters())
        micro = settings.micro_batch_size(R)
        config = {
            "train_batch_size": settings.global_batch_size,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": settings.accumulate_grad_batches,
            "gradient_clipping": 0.0,  # the trainer clips by the global norm
            "steps_per_print": 2**31 - 1,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=pipe_module, optimizer=self.optimizer, config=config)
        self.stage_index = self.engine.stage_id
        assert self.stage_index == env.rank % S, "DeepSpeed topology disagrees with the rank layout"
        self.replicas = R
        self._pp_ranks = [(env.rank // S) * S + s for s in range(S)]
        self._pp_group = self.engine.grid.get_pipe_parallel_group()
        self._dp_group = self.engine.grid.get_data_parallel_group()
        self._mine = [self.stage_index]
        self._chunk_modules = {self.stage_index: pipe_module}
        self._runners = []
        self._n = settings.accumulate_grad_batches
        self.module = pipe_module
        self.model = self.engine

    def _ds_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss is not None
        loss_fn, _, _, record = self._loss
        loss = loss_fn(output, target)
        # Undivided: the engine's backward divides by gradient_accumulation_steps.
        record.append((loss, loss.detach()))
        return loss

    def forward_backward(self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, precision: Precision) -> list[torch.Tensor]:
        from deepspeed.runtime.pipe import schedule as ds_schedule

        assert self.env is not None
        n = len(micro_batches)
        if n != self._n:
            raise RuntimeError(f"the engine was configured for {self._n} micro-batches, got {n}")

        class TrainWithoutStep(ds_schedule.TrainSchedule):
            def steps(self):  # type: ignore[override]
                for commands in super().steps():
                    yield [c for c in commands if not isinstance(c, ds_schedule.OptimizerStep)]

        record: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._loss = (loss_fn, precision, n, record)
        engine = self.engine
        try:
            engine.set_dataiterator(iter([(_tensor(x, "inputs"), _tensor(y, "targets")) for x, y in micro_batches]))
            engine.module.train()
            engine.total_loss = None
            engine._compute_loss = True
            engine._exec_schedule(
                TrainWithoutStep(micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id)
            )
        finally:
            self._loss = None
        device = self.env.device
        if self.is_last:
            losses = torch.stack([loss for _, loss in record]).float().to(device)
        else:
            losses = torch.zeros(n, dtype=torch.float32, device=device)
        if self.options.stages > 1:
            dist.broadcast(losses, src=self._last_rank, group=self._pp_group)
        return list(losses.unbind())

    def make_grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        raise NotImplementedError("deepspeed_pipeline supports fp32 only")

    def teardown(self) -> None:
        super().teardown()
        self.engine = None


class _WorldGradScaler(torch.amp.GradScaler):
    """A GradScaler whose overflow flag is the OR over every rank.

    Each stage only sees its own gradients; without this, a stage that did
    not overflow would step while another skipped, and their scales would
    drift apart.
    """

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # Only the last stage scales a loss, which is where GradScaler creates
        # its scale; the other stages start from the same initial scale and
        # stay equal because every update sees the same (world) overflow flag.
        if self._enabled and self._scale is None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self._lazy_init_scale_growth_tracker(grads[0].device if grads else torch.device(self._device))
        super().unscale_(optimizer)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # type: ignore[override]
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if dist.is_available() and dist.is_initialized():
            for flag in per_device.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return per_device


def _tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"strategy 'pipeline' needs {what} to be a single tensor, got {type(value).__name__}")
    return value


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]


def _send_tensor(t: torch.Tensor, dst: int) -> None:
    header = torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape], dtype=torch.int64, device=t.device)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=t.device), dst)
    dist.send(header, dst)
    dist.send(t.contiguous(), dst)


def _recv_tensor(src: int, device: torch.device) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    header = torch.zeros(int(size), dtype=torch.int64, device=device)
    dist.recv(header, src)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    out = torch.empty([int(v) for v in header[2 : 2 + ndim]], dtype=dtype, device=device)
    dist.recv(out, src)
    return out


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="pipeline",
            factory=PipelineStrategy,
            description="torch.distributed.pipelining (GPipe, 1F1B, interleaved, zero-bubble) over an nn.Sequential; "
            "schedule-owned accumulation",
            options=PipelineOptions,
        ),
        StrategySpec(
            name="deepspeed_pipeline",
            factory=DeepSpeedPipelineStrategy,
            description="DeepSpeed PipelineModule + PipelineEngine over an nn.Sequential (fp32); "
            "schedule-owned accumulation",
            options=DeepSpeedPipelineOptions,
            unavailable=missing_modules("deepspeed"),
        ),
    ]
