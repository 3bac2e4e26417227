"""``pipeline``: pipeline parallelism with ``torch.distributed.pipelining``.

The model must be an ``nn.Sequential``. Its children are cut into ``stages``
contiguous runs; rank ``r * stages + s`` holds stage ``s`` of data-parallel
replica ``r`` (``world_size = stages * replicas``). One optimizer step is one
pipeline schedule (GPipe or 1F1B) over the step's ``accumulate_grad_batches``
micro-batches, so the schedule, not the trainer, owns accumulation.

Decisions, and why:

* **Manual split, no tracing.** Each stage is built from the Sequential's own
  children and wrapped in :class:`~torch.distributed.pipelining.PipelineStage`.
  Tracing (``pipeline()``/``SplitPoint``) would rename parameters and fail on
  models torch.export cannot capture; a Sequential already says where the cuts
  may go.
* **Original names everywhere.** A stage module is an ``nn.Sequential`` whose
  children keep their original names (``"2"``, ``"3"``, ``"4"``), so a stage's
  ``state_dict()`` keys *are* the full model's keys (``"2.weight"``). That one
  choice makes ``full_state_dict`` a plain merge and makes the checkpoint the
  same DCP layout ``ddp``/``single`` write: a checkpoint from either resumes
  under the other.
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
* **Global clipping.** Each stage holds a slice of the model, so the global
  norm is the square root of the squared stage norms all-reduced over the
  pipeline; every stage clips by that same number.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, ContextManager, Literal, Sequence

import pydantic
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from unison.errors import ConfigurationError
from unison.ownership import (
    AccumulationOwner,
    GradAccumulation,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
    StateDictDeclaration,
    StateDictKind,
)
from unison.plugin import hookimpl
from unison.precision import Precision
from unison.registry import StrategySpec
from unison.state import canonical
from unison.strategy import DistEnv, LossFn, OptimizerFactory, Strategy

SCHEDULES = ("gpipe", "1f1b")


class PipelineOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    stages: int = pydantic.Field(2, ge=1)
    """Pipeline stages per replica; the world size must be a multiple of it."""
    schedule: Literal["gpipe", "1f1b"] = "gpipe"
    """``gpipe`` (all forwards, then all backwards) or ``1f1b`` (one forward, one backward in steady state)."""
    balance: list[int] | None = None
    """Children of the Sequential per stage; ``None`` balances by parameter count."""


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


def _check_model(model: torch.nn.Module, stages: int, balance: list[int] | None) -> list[int]:
    """The balance to use, or a ConfigurationError explaining why the model cannot be split."""
    if not isinstance(model, torch.nn.Sequential):
        raise ConfigurationError(
            "model",
            f"strategy 'pipeline' splits an nn.Sequential into stages, got {type(model).__name__}",
            "express the model as torch.nn.Sequential of its layers (each layer's output is the next one's input)",
        )
    children = list(model.named_children())
    n = len(children)
    if stages > n:
        raise ConfigurationError(
            "strategy_options.stages",
            f"{stages} stages need at least {stages} layers, but the Sequential has {n}",
            f"use stages <= {n}",
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
                    f"parameter {name!r} is shared between stage {owner[id(p)]} and stage {s} (tied weights)",
                    "put the layers that share the parameter in the same stage with strategy_options.balance",
                )
    return list(balance)


# --------------------------------------------------------------------------- #
# The strategy
# --------------------------------------------------------------------------- #
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
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = PipelineOptions(**options)
        o = self.options
        if o.balance is not None and (len(o.balance) != o.stages or any(c < 1 for c in o.balance)):
            raise ConfigurationError(
                "strategy_options.balance",
                f"balance {o.balance} must hold {o.stages} positive layer counts (one per stage)",
                f"give {o.stages} counts >= 1, or omit balance to balance by parameter count",
            )
        self._loss: tuple[LossFn, Precision, int, list[torch.Tensor]] | None = None

    # -- declaration ------------------------------------------------------- #
    @property
    def ownership(self) -> Ownership:
        o = self.options
        return Ownership(
            grad_accumulation=GradAccumulation(
                AccumulationOwner.SCHEDULE,
                f"torch.distributed.pipelining {'ScheduleGPipe' if o.schedule == 'gpipe' else 'Schedule1F1B'} with "
                "n_microbatches = accumulate_grad_batches; the schedule backpropagates loss / n (scale_grads=False), "
                "then each stage all-reduces (mean) its gradients over data-parallel replicas once per step",
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
            state_dict=StateDictDeclaration(
                kind=StateDictKind.SHARDED,
                format="torch.distributed.checkpoint (DCP), keys = the Sequential's own parameter names, optimizer "
                "state keyed by name (the layout ddp/single write); each stage writes its own layers",
                reshardable=True,
                canonical_export="each stage's state_dict (original names) all-gathered over the pipeline, "
                "fp32, on CPU, on every rank",
            ),
            notes=(
                "the model must be an nn.Sequential; stages are contiguous runs of its children",
                "activations between stages must be single tensors",
                "schedules offered: gpipe, 1f1b; interleaved and zero-bubble schedules need several stages per rank "
                "(virtual stages) and are not offered",
                "validation runs a plain forward through the stages (no schedule), one batch at a time",
            ),
        )

    def data_parallel_size(self, world_size: int) -> int:
        return max(1, world_size // self.options.stages)

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        return rank // self.options.stages

    def data_parallel_group(self) -> Any:
        return self._dp_group

    def validate(self, settings: Any, world_size: int) -> None:
        o = self.options
        if world_size % o.stages:
            raise ConfigurationError(
                "strategy_options.stages",
                f"world size {world_size} is not a multiple of stages={o.stages}",
                f"launch a multiple of {o.stages} processes, or set stages to a divisor of {world_size}",
            )
        if o.schedule == "1f1b" and settings.accumulate_grad_batches < o.stages:
            raise ConfigurationError(
                "accumulate_grad_batches",
                f"schedule '1f1b' needs at least as many micro-batches as stages ({o.stages}), "
                f"got accumulate_grad_batches={settings.accumulate_grad_batches}",
                f"set accumulate_grad_batches >= {o.stages}, or use schedule='gpipe'",
            )

    def validate_model(self, model: torch.nn.Module, settings: Any) -> None:
        _check_model(model, self.options.stages, self.options.balance)

    # -- setup ------------------------------------------------------------- #
    def _make_groups(self, env: DistEnv) -> None:
        """Pipeline and data-parallel groups; every rank creates every group, in one order."""
        if getattr(self, "_groups_for", None) == env.world_size:
            return
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
        self._groups_for = env.world_size

    def setup(self, module: torch.nn.Module, make_optimizer: OptimizerFactory, *, precision: Any, env: DistEnv, settings: Any) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        o = self.options
        self.env = env
        self._make_groups(env)
        balance = _check_model(module, o.stages, o.balance)
        self.stage_index = env.rank % o.stages
        self.replicas = env.world_size // o.stages
        self._pp_ranks = [(env.rank // o.stages) * o.stages + s for s in range(o.stages)]
        stages = split_sequential(module, balance)
        stage = stages[self.stage_index].to(env.device)
        self.module = stage
        self._runner = _StageForward(stage)
        self._n = settings.accumulate_grad_batches
        self.pipe_stage = PipelineStage(self._runner, self.stage_index, o.stages, env.device, group=self._pp_group)
        schedule_cls = ScheduleGPipe if o.schedule == "gpipe" else Schedule1F1B
        # scale_grads=False: the mean over micro-batches is taken in the loss
        # (loss / n), as the trainer does for every other backend.
        self.schedule = schedule_cls(self.pipe_stage, self._n, loss_fn=self._schedule_loss, scale_grads=False)
        self.model = self.schedule
        self.optimizer = make_optimizer(stage.parameters())

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.options.stages - 1

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
        record.append(loss.detach())
        # The one place the loss is divided for accumulation (see module doc).
        return precision.scale_loss(loss / n)

    def forward_backward(self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, precision: Precision) -> list[torch.Tensor]:
        assert self.env is not None
        n = len(micro_batches)
        if n != self._n:
            raise RuntimeError(f"pipeline schedule was built for {self._n} micro-batches, got {n}")
        record: list[torch.Tensor] = []
        self._loss = (loss_fn, precision, n, record)
        self._runner.precision = precision
        device = self.env.device
        try:
            # step() re-splits a whole batch along dim 0; equal micro-batches
            # concatenated and re-split are exactly the trainer's micro-batches.
            if self.is_first:
                inputs = torch.cat([_tensor(precision.convert_input(x), "inputs").to(device) for x, _ in micro_batches])
            if self.is_last:
                target = torch.cat([_tensor(y, "targets").to(device) for _, y in micro_batches])
            if self.is_first and self.is_last:
                self.schedule.step(inputs, target=target, return_outputs=False)
            elif self.is_first:
                self.schedule.step(inputs, return_outputs=False)
            elif self.is_last:
                self.schedule.step(target=target, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        finally:
            self._loss = None
            self._runner.precision = Precision()
        self._all_reduce_grads()
        # Every rank of the pipeline returns the last stage's micro-batch losses,
        # so the trainer's reduce_mean over replicas is the same everywhere.
        losses = torch.stack(record).float() if self.is_last else torch.zeros(n, dtype=torch.float32, device=device)
        losses = losses.to(device)
        if self.options.stages > 1:
            dist.broadcast(losses, src=self._pp_ranks[-1], group=self._pp_group)
        return list(losses.cpu().unbind())

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
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True) if grads else torch.zeros(())
        squared = (local.float() ** 2).to(self.env.device).reshape(1)
        if self.options.stages > 1:
            # Gradients are equal across replicas, so the pipeline holds the whole model.
            dist.all_reduce(squared, group=self._pp_group)
        norm = squared.sqrt().reshape(())
        if max_norm is not None and grads:
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=True)
        return norm

    def make_grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        return _WorldGradScaler(device.type)

    @torch.no_grad()
    def eval_loss(self, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """Plain forward through the stages, one stage after the other.

        Validation batches differ in size from training micro-batches, and the
        schedule's communication buffers are sized for the latter, so the
        activations are passed point to point here instead.
        """
        assert self.env is not None and self.module is not None
        device = self.env.device
        S = self.options.stages
        if self.is_first:
            x = _tensor(inputs, "inputs").to(device)
        else:
            x = _recv_tensor(self._pp_ranks[self.stage_index - 1], device)
        out = self.module(x)
        if not self.is_last:
            _send_tensor(_tensor(out, "stage output"), self._pp_ranks[self.stage_index + 1])
            loss = torch.zeros((), dtype=torch.float32, device=device)
        else:
            loss = loss_fn(out, targets.to(device) if isinstance(targets, torch.Tensor) else targets).float()
        if S > 1:
            loss = loss.reshape(1).contiguous()
            dist.broadcast(loss, src=self._pp_ranks[-1], group=self._pp_group)
        return loss.reshape(())

    # -- state ------------------------------------------------------------- #
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        mine = canonical(self.module.state_dict())
        if self.options.stages == 1:
            return mine
        parts: list[Any] = [None] * self.options.stages
        dist.all_gather_object(parts, mine, group=self._pp_group)
        full: dict[str, torch.Tensor] = {}
        for part in parts:  # stage order = the Sequential's order
            full.update(part)
        return full

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
            group["params"] = [n for part in parts for n in part[i]]

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
        self.schedule = self.pipe_stage = None
        self._runner = None


class _WorldGradScaler(torch.amp.GradScaler):
    """A GradScaler whose overflow flag is the OR over every rank.

    Each stage only sees its own gradients; without this, a stage that did
    not overflow would step while another skipped, and their scales would
    drift apart.
    """

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
            description="torch.distributed.pipelining (GPipe/1F1B) over an nn.Sequential; schedule-owned accumulation",
            options=PipelineOptions,
        )
    ]
