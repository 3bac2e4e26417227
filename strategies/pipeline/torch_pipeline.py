"""``pipeline``: pipeline parallelism with ``torch.distributed.pipelining``.

The model must be an ``nn.Sequential``, or a module that declares its split
points with ``pipeline_layers`` (see :func:`~.layout.as_layers`). Its children
are cut into ``stages * stages_per_rank`` contiguous *model chunks*, each one a
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
``nn.Sequential`` of the layers this rank trains, under their original names
(see :mod:`.base` for what that buys).

Decisions, and why:

* **Manual split, no tracing.** Each chunk is built from the Sequential's own
  children and wrapped in :class:`~torch.distributed.pipelining.PipelineStage`.
  Tracing (``pipeline()``/``SplitPoint``) would rename parameters and fail on
  models torch.export cannot capture; a Sequential already says where the cuts
  may go.
* **Process groups from a named DeviceMesh.** ``init_device_mesh(device,
  (replicas, stages), mesh_dim_names=("dp", "pp"))`` lays ranks out exactly as
  above (row-major: ``rank = replica * stages + stage``); its ``"pp"`` group
  carries the schedule's sends and the validation loss's broadcast, its ``"dp"``
  group the gradient all-reduce. It is made afresh at every setup: a group does not
  outlive the process group the trainer may destroy at the end of ``fit``.
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
* **Precision inside the schedule.** Each chunk enters the trainer's
  ``forward_context`` (autocast) around its own forward, and the last chunk
  around the loss; backward runs outside it, as for every other backend. For
  fp16 the GradScaler's overflow flag is all-reduced over the world, because
  each rank only sees its own gradients.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal

import pydantic
import torch
import torch.distributed as dist

from unison._upstream.torch import (
    FlagReducingGradScaler,
    buffer_keeping_pipeline_stage,
    flatten_dense_tensors,
    unflatten_dense_tensors,
)
from unison.contract.env import DistEnv
from unison.contract.ownership import (
    AccumulationOwner,
    GradAccumulation,
    LossNormalisation,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
)
from unison.contract.precision import Precision
from unison.contract.strategy import LossFn, OptimizerFactory
from unison.errors import ConfigurationError
from unison.strategies.pipeline.base import (
    PIPELINE_REFUSALS,
    PIPELINE_STATE,
    StagedStrategy,
    pipeline_world_sizes,
    split_pair,
)
from unison.strategies.pipeline.layout import (
    SCHEDULES,
    ChunkLayout,
    as_layers,
    check_micro_batches,
    check_model,
    split_sequential,
)
from unison.strategies.pipeline.p2p import as_tensor


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


def layout_of(options: PipelineOptions) -> ChunkLayout:
    """The chunk layout the options ask for, or a ConfigurationError (no process group needed)."""
    placement = SCHEDULES[options.schedule][1]
    per_rank = options.stages_per_rank or (1 if placement == "single" else 2)
    if placement == "single" and per_rank != 1:
        raise ConfigurationError(
            "strategy_options.stages_per_rank",
            f"schedule {options.schedule!r} runs one model chunk per rank, got stages_per_rank={per_rank}",
            "omit stages_per_rank, or pick interleaved_1f1b / looped_bfs / interleaved_zero_bubble",
        )
    if placement == "v" and per_rank != 2:
        raise ConfigurationError(
            "strategy_options.stages_per_rank",
            f"schedule 'zbv_zero_bubble' places exactly 2 model chunks per rank, got {per_rank}",
            "omit stages_per_rank or set it to 2",
        )
    layout = ChunkLayout(options.stages, per_rank, placement)
    balance = options.balance
    if balance is not None and (len(balance) != layout.chunks or any(c < 1 for c in balance)):
        raise ConfigurationError(
            "strategy_options.balance",
            f"balance {balance} must hold {layout.chunks} positive layer counts (one per model chunk: "
            f"stages={options.stages} x stages_per_rank={per_rank})",
            f"give {layout.chunks} counts >= 1, or omit balance to balance by parameter count",
        )
    return layout


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


class WorldGradScaler(FlagReducingGradScaler):
    """A GradScaler whose overflow flag is the OR over every rank.

    Each stage only sees its own gradients; without this, a stage that did
    not overflow would step while another skipped, and their scales would
    drift apart.
    """

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # Only the last stage scales a loss, which is where GradScaler creates
        # its scale; the other stages start from the same initial scale and
        # stay equal because every update sees the same (world) overflow flag.
        self.ensure_scale(optimizer)
        super().unscale_(optimizer)

    def combine_found_inf(
        self, per_device: dict[torch.device, torch.Tensor], found_inf: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        if dist.is_available() and dist.is_initialized():
            for flag in per_device.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return per_device


class PipelineStrategy(StagedStrategy):
    """Schedule-owned accumulation over model chunks of an ``nn.Sequential`` (see the module doc).

    Construction validates the options alone; :meth:`validate` checks them
    against the micro-batch count, :meth:`validate_model` against the model,
    both before any process group starts.
    """

    #: The options model this strategy's options are validated against (``pipeline_fsdp`` extends it).
    options_model: type[PipelineOptions] = PipelineOptions

    def __init__(self, **options: Any) -> None:
        self.options = self.options_model(**options)
        super().__init__(layout_of(self.options))
        self._loss: (
            tuple[LossFn, Precision, int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] | None
        ) = None
        self._runners: list[_StageForward] = []
        self.pipe_stages: list[Any] = []
        self.schedule: Any = None

    # -- declaration ------------------------------------------------------- #
    @property
    def ownership(self) -> Ownership:
        o = self.options
        return Ownership(
            loss_normalisation=LossNormalisation(
                over=(
                    "each stage's data-parallel replicas: one all-reduce (mean) per stage "
                    "after the schedule (the schedule's loss / n divides)"
                )
            ),
            grad_accumulation=GradAccumulation(
                AccumulationOwner.SCHEDULE,
                f"torch.distributed.pipelining {SCHEDULES[o.schedule][0]} ({self.layout.per_rank} model chunk(s) "
                "per rank) with n_microbatches = accumulate_grad_batches; the schedule backpropagates loss / n "
                "(scale_grads=False), then each rank all-reduces (mean) its gradients over data-parallel replicas "
                "once per step",
            ),
            precision={
                "32-true": PrecisionSupport(PrecisionOwner.TRAINER, "fp32 parameters, activations and compute"),
                "bf16-mixed": PrecisionSupport(
                    PrecisionOwner.TRAINER,
                    "the trainer's torch.autocast(bfloat16), entered by each stage around its forward and around "
                    "the loss on the last stage; backward runs outside autocast",
                ),
                "bf16-true": PrecisionSupport(
                    PrecisionOwner.TRAINER,
                    "module.to(bfloat16) and bf16 inputs by the trainer; bf16 activations cross stages",
                ),
                "16-mixed": PrecisionSupport(
                    PrecisionOwner.TRAINER,
                    "torch.autocast(float16) per stage + a GradScaler whose overflow flag is all-reduced over the "
                    "world, so every stage skips the same steps and keeps the same scale",
                ),
            },
            state_dict=PIPELINE_STATE,
            refuses=PIPELINE_REFUSALS,
            world_sizes=pipeline_world_sizes(o.stages),
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

    def validate(self, settings: Any, world_size: int) -> None:
        # The world size is checked against the declaration (world_sizes) by the trainer.
        check_micro_batches(self.options.schedule, self.layout, settings.accumulate_grad_batches)

    def validate_model(self, model: torch.nn.Module, settings: Any) -> None:
        check_model(model, self.layout.chunks, self.options.balance, self.layout.per_rank)

    # -- setup ------------------------------------------------------------- #
    def _device_mesh(self, env: DistEnv) -> Any:
        """This world's named ``("dp", "pp")`` DeviceMesh (module doc); its groups carry every collective."""
        from torch.distributed.device_mesh import init_device_mesh

        S = self.layout.stages
        return init_device_mesh(env.device.type, (env.world_size // S, S), mesh_dim_names=("dp", "pp"))

    def _prepare_stages(self, runners: list[_StageForward], mesh: Any, precision: Any) -> None:
        """What happens to each stage's module before it becomes a ``PipelineStage``: nothing here.

        ``pipeline_fsdp`` shards each one with FSDP2 on the ``"dp"`` sub-mesh.
        """

    def configure_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # The whole model stays where it was built: each rank moves only its own stages to its device (build).
        return module

    # The template's apply_features checkpoints the blocks before the split (the blocks are the split points,
    # or the model's `blocks`), so each stage's schedule recomputes its own blocks' forward in its backward;
    # compile is a declared refusal.

    def build(self, module: torch.nn.Module, make_optimizer: OptimizerFactory) -> tuple[Any, torch.optim.Optimizer]:
        # Splitting into stages builds the modules this rank trains, and the schedule is what the trainer calls.
        env, precision, settings = self.env, self.precision, self.settings
        assert env is not None and precision is not None and settings is not None
        from torch.distributed import pipelining

        o, layout = self.options, self.layout
        mesh = self._device_mesh(env)
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        balance = check_model(module, layout.chunks, o.balance, layout.per_rank)
        module = as_layers(module)
        chunks = split_sequential(module, balance)
        mine = layout.chunks_of(layout.stage_of(env.rank))
        # Everything this rank trains, under the original names (what the
        # optimizer, clipping, state dicts and train()/eval() see).
        self.module = torch.nn.Sequential(
            OrderedDict((name, child) for k in mine for name, child in chunks[k].named_children())
        ).to(env.device)
        self._place(
            env,
            module,
            {k: chunks[k] for k in mine},
            pp_group=pp_group,
            dp_group=dp_group,
            micro_batches=settings.accumulate_grad_batches,
        )
        self._runners = [_StageForward(chunks[k]) for k in mine]
        self._prepare_stages(self._runners, mesh, precision)
        # A PipelineStage whose one-time shape inference (a forward before the
        # first step) does not update buffers such as BatchNorm's statistics.
        stage_class = buffer_keeping_pipeline_stage()
        self.pipe_stages = [
            stage_class(runner, k, layout.chunks, env.device, group=pp_group) for k, runner in zip(mine, self._runners)
        ]
        schedule_cls = getattr(pipelining, SCHEDULES[o.schedule][0])
        # scale_grads=False: the mean over micro-batches is taken in the loss
        # (loss / n), as the trainer does for every other backend.
        self.schedule = schedule_cls(
            self.pipe_stages[0] if layout.placement == "single" else self.pipe_stages,
            self._n,
            loss_fn=self._schedule_loss,
            scale_grads=False,
        )
        return self.schedule, make_optimizer(self.module.parameters())

    # -- hot path ---------------------------------------------------------- #
    def _schedule_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss is not None
        loss_fn, precision, n, record = self._loss
        with precision.forward_context():
            loss, items = split_pair(loss_fn(output, target))
        # The one place the loss is divided for accumulation (see module doc); a (loss_sum, num_items) pair's
        # sum likewise (the trainer scales the gradients by the step's global item count afterwards).
        scaled = precision.scale_loss(loss / n)
        # The stage's one-time shape inference also calls this loss (on empty
        # tensors); only the losses the schedule reports back are real, so
        # they are matched by identity after the step.
        record.append((scaled, loss.detach(), items))
        return scaled

    def forward_backward(
        self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, precision: Precision
    ) -> list[torch.Tensor]:
        assert self.env is not None
        n = len(micro_batches)
        self._check_micro_batch_count(n)
        record: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        reported: list[torch.Tensor] = []
        self._loss = (loss_fn, precision, n, record)
        for runner in self._runners:
            runner.precision = precision
        device = self.env.device
        try:
            # step() re-splits a whole batch along dim 0; equal micro-batches
            # concatenated and re-split are exactly the trainer's micro-batches.
            if self.is_first:
                inputs = torch.cat(
                    [as_tensor(precision.convert_input(x), "inputs").to(device) for x, _ in micro_batches]
                )
            if self.is_last:
                target = torch.cat([as_tensor(y, "targets").to(device) for _, y in micro_batches])
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
        # The last stage returns its micro-batch losses, the other stages zeros: the trainer's sum over the
        # world (reports_step_losses) brings every replica's to every rank.
        undivided = (
            [next((loss, items) for scaled, loss, items in record if scaled is r) for r in reported]
            if self.is_last
            else None
        )
        return self._step_losses(undivided, n)

    def _all_reduce_grads(self) -> None:
        """Mean of each stage's gradients over its data-parallel replicas (one flat all-reduce)."""
        if self.replicas == 1:
            return
        assert self.module is not None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = flatten_dense_tensors(grads)
        flat.div_(self.replicas)
        dist.all_reduce(flat, group=self._dp_group)
        for g, synced in zip(grads, unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def make_grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        return WorldGradScaler(device.type)

    def teardown(self) -> None:
        super().teardown()
        self.schedule = None
        self.pipe_stages = self._runners = []


__all__ = ["PipelineOptions", "PipelineStrategy", "WorldGradScaler", "layout_of"]
