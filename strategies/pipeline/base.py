"""What both pipeline strategies share: placement, losses, clipping, validation and state.

:class:`StagedStrategy` is the common base of ``pipeline`` (torch.distributed.pipelining)
and ``deepspeed_pipeline`` (DeepSpeed's PipelineEngine). Each subclass builds its own
stages and runs its own schedule in ``setup`` / ``forward_backward``, then records what
this rank holds with :meth:`StagedStrategy._place`; everything after the schedule is
here, written once:

* **Losses on every rank.** Only the last chunk sees the loss; its stage
  reports the undivided per-micro-batch losses and the other stages return
  zeros (:meth:`StagedStrategy.reports_step_losses`, plugin API 2.4): the
  trainer's one sum over the world, which it runs anyway to sum the replicas,
  brings them to every rank, so every rank logs the same numbers.
* **Global clipping.** Each rank holds a slice of the model, so the global
  norm is the square root of the squared per-rank norms all-reduced over the
  pipeline; every rank clips by that same number.
* **Original names everywhere.** A rank's module is an ``nn.Sequential`` whose
  children keep their original names, so its ``state_dict()`` keys *are* the
  full model's keys. ``full_state_dict`` is a plain merge, and the checkpoint
  is the DCP layout ``ddp``/``single`` write (``model.<name>``,
  ``optim.state.<name>.<key>``, ``optim.param_groups.<i>.*`` listing every
  parameter of the model): a checkpoint from any of them resumes under any
  other, at any world size and any cut.
* **Validation without the schedule.** A plain forward through the chunks,
  activations passed point to point (:mod:`.p2p`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unison.contract.env import DistEnv
from unison.contract.ownership import Feature, StateDictDeclaration, StateDictKind, WorldSizes
from unison.contract.strategy import LossFn, Strategy, canonical
from unison.strategies.pipeline.layout import ChunkLayout
from unison.strategies.pipeline.p2p import as_tensor, recv_tensor, send_tensor

PIPELINE_STATE = StateDictDeclaration(
    kind=StateDictKind.SHARDED,
    format="torch.distributed.checkpoint (DCP), keys = the Sequential's own parameter names, optimizer "
    "state keyed by name (the layout ddp/single write); each rank writes its own layers",
    reshardable=True,
    canonical_export="each rank's state_dict (original names) all-gathered over the pipeline, fp32, on CPU, "
    "on every rank",
)

#: What a pipeline cannot take, and why (shown by ``unison describe``; refused before training).
PIPELINE_REFUSALS = {
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
    Feature.COMPILE: (
        "a stage's forward runs inside the pipeline schedule, and unison compiles no stage: train uncompiled, or "
        "compile with a data-parallel strategy (single, ddp, fsdp)"
    ),
}


def pipeline_world_sizes(stages: int) -> WorldSizes:
    """World sizes a pipeline of ``stages`` ranks per replica runs at."""
    return WorldSizes(
        minimum=stages,
        multiple_of=stages,
        reason=f"each data-parallel replica is a pipeline of stages={stages} ranks",
    )


class StagedStrategy(Strategy):
    """Schedule-owned accumulation over contiguous model chunks (see the module doc)."""

    def __init__(self, layout: ChunkLayout) -> None:
        super().__init__()
        self.layout = layout
        #: This rank's place in its pipeline (0..stages-1); set by :meth:`_place`.
        self.stage_index = 0
        #: Data-parallel replicas of the whole pipeline.
        self.replicas = 1
        self._pp_ranks: list[int] = []
        self._pp_group: Any = None
        self._dp_group: Any = None
        #: The chunks this rank holds, in pipeline order, and their modules.
        self._mine: list[int] = []
        self._chunk_modules: dict[int, torch.nn.Module] = {}
        self._full_keys: list[str] = []
        self._param_order: dict[str, int] = {}
        #: Micro-batches per optimizer step the schedule was built for.
        self._n = 0

    # -- placement --------------------------------------------------------- #
    def _place(
        self,
        env: DistEnv,
        full: torch.nn.Module,
        chunk_modules: dict[int, torch.nn.Module],
        *,
        pp_group: Any,
        dp_group: Any,
        micro_batches: int,
    ) -> None:
        """Record where this rank sits and what it holds; called once by each subclass's ``setup``.

        ``full`` is the whole chain of layers (its names and order are the
        canonical ones); ``chunk_modules`` maps each chunk this rank holds to
        the module that runs it.
        """
        layout = self.layout
        self.stage_index = layout.stage_of(env.rank)
        self.replicas = layout.replicas(env.world_size)
        self._pp_ranks = layout.pipeline_ranks(env.rank)
        self._pp_group, self._dp_group = pp_group, dp_group
        self._mine = layout.chunks_of(self.stage_index)
        assert sorted(chunk_modules) == self._mine, "chunk modules disagree with the layout"
        self._chunk_modules = chunk_modules
        self._full_keys = list(full.state_dict().keys())
        self._param_order = {name: i for i, (name, _) in enumerate(full.named_parameters())}
        self._n = micro_batches

    def data_parallel_size(self, world_size: int) -> int:
        return self.layout.replicas(world_size)

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        return self.layout.replica_of(rank)

    def data_parallel_group(self) -> Any:
        return self._dp_group

    @property
    def is_first(self) -> bool:
        """Holds the first model chunk (feeds the inputs)."""
        return 0 in self._mine

    @property
    def is_last(self) -> bool:
        """Holds the last model chunk (computes the loss)."""
        return self.layout.chunks - 1 in self._mine

    @property
    def _last_rank(self) -> int:
        return self._pp_ranks[self.layout.chunk_owner(self.layout.chunks - 1)]

    # -- hot path ---------------------------------------------------------- #
    def forward(self, inputs: Any) -> Any:
        raise NotImplementedError(
            f"strategy {self.name!r} holds some model chunks per rank and owns the schedule: the trainer calls "
            "forward_backward()"
        )

    def _check_micro_batch_count(self, n: int) -> None:
        if n != self._n:
            raise RuntimeError(f"strategy {self.name!r} was set up for {self._n} micro-batches per step, got {n}")

    def reports_step_losses(self) -> bool | None:
        """The stage that computes the loss reports the step's losses (plugin API 2.4): the trainer's one
        sum over the world brings them to the other stages, which return zeros, so the schedule sends no
        losses of its own. A subclass that answers ``None`` has them broadcast over the pipeline instead."""
        return self.is_last

    def _step_losses(
        self, last_stage_losses: list[tuple[torch.Tensor, torch.Tensor | None]] | None, n: int
    ) -> list[Any]:
        """The last stage's undivided micro-batch losses as ``(loss, items)`` pairs, ``items`` -1 for a mean
        loss: the other stages cannot know which form the loss took without reading the device, so every
        stage returns the pair and the trainer decides on the device (``TrainLoop._normalise``).

        On the other stages, zeros (:meth:`reports_step_losses`), or, where it answers ``None``, the last
        stage's rows, broadcast over the pipeline.
        """
        assert self.env is not None
        device = self.env.device
        if self.is_last:
            assert last_stage_losses is not None
            rows = torch.stack(
                [
                    torch.stack([loss.float().reshape(()).to(device), _items_or_none(items, device)])
                    for loss, items in last_stage_losses
                ]
            )
        else:
            rows = torch.zeros(n, 2, dtype=torch.float32, device=device)
        if self.layout.stages > 1 and self.reports_step_losses() is None:
            dist.broadcast(rows, src=self._last_rank, group=self._pp_group)
        return [(row[0], row[1]) for row in rows.unbind()]

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None and self.env is not None
        params = [p for p in self.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        local = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True) if grads else torch.zeros(())
        squared = (local.float() ** 2).to(self.env.device).reshape(1)
        if self.layout.stages > 1:
            # Gradients are equal across replicas, so the pipeline holds the whole model.
            dist.all_reduce(squared, group=self._pp_group)
        norm = squared.sqrt().reshape(())
        if max_norm is not None and params:
            # clip_grads_with_norm_ scales p.grad of the parameters it is given.
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.to(grads[0].device), foreach=True)
        return norm

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
        owner = self.layout.chunk_owner
        x: Any = None
        for k in range(self.layout.chunks):
            if owner(k) != self.stage_index:
                continue
            if k == 0:
                x = as_tensor(inputs, "inputs").to(device)
            elif owner(k - 1) != owner(k):
                x = recv_tensor(self._pp_ranks[owner(k - 1)], device)
            x = self._chunk_modules[k](x)
            if k + 1 < self.layout.chunks and owner(k + 1) != owner(k):
                send_tensor(as_tensor(x, "stage output"), self._pp_ranks[owner(k + 1)])
        if self.is_last:
            loss, items = split_pair(loss_fn(x, targets.to(device) if isinstance(targets, torch.Tensor) else targets))
            row = torch.stack([loss.float().reshape(()).to(device), _items_or_none(items, device)])
        else:
            row = torch.zeros(2, dtype=torch.float32, device=device)
        if self.layout.stages > 1:
            dist.broadcast(row, src=self._last_rank, group=self._pp_group)
        loss, items = row.unbind()
        # Validation reads its losses anyway: -1 marks a mean (a pair's count is never negative).
        return loss if bool(items < 0) else (loss, items)

    # -- state ------------------------------------------------------------- #
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        from torch.distributed.tensor import DTensor

        # A stage sharded over its replicas (pipeline_fsdp) holds DTensors: full_tensor() all-gathers them.
        local = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.module.state_dict().items()}
        mine = canonical(local)
        if self.layout.stages == 1:
            return mine
        parts: list[Any] = [None] * self.layout.stages
        dist.all_gather_object(parts, mine, group=self._pp_group)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        # The Sequential's own order (ranks may hold non-adjacent chunks).
        return {k: merged[k] for k in self._full_keys if k in merged} | merged

    def _optim_state(self) -> dict[str, Any]:
        # Keyed by the stage's parameter names, which are the model's names.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer, options=StateDictOptions())

    def save_state(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp  # imported on use: describing a strategy never loads it

        assert self.module is not None and self.optimizer is not None
        optim = self._optim_state()
        # ddp/single list every parameter of the model in each param group; so
        # do we (the same on every rank), so that they can load this file.
        if self.layout.stages > 1:
            self._gather_group_names(optim)
        state = {"model": dict(self.module.state_dict()), "optim": optim}
        dcp.save(state, checkpoint_id=str(directory))

    def _gather_group_names(self, optim: dict[str, Any]) -> None:
        """With several param groups, each group's full name list is the union over stages."""
        local = [list(g["params"]) for g in optim["param_groups"]]
        parts: list[Any] = [None] * self.layout.stages
        dist.all_gather_object(parts, local, group=self._pp_group)
        for i, group in enumerate(optim["param_groups"]):
            # In the model's own parameter order, as ddp/single list them.
            group["params"] = sorted((n for part in parts for n in part[i]), key=self._param_order.__getitem__)

    def load_state(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

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


__all__ = ["PIPELINE_REFUSALS", "PIPELINE_STATE", "StagedStrategy", "pipeline_world_sizes"]


def split_pair(value: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A ``loss_fn`` result as ``(loss, items)``: a mean loss has no items; a ``(loss_sum, num_items)`` pair has."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        loss, items = value
        return loss, torch.as_tensor(items, dtype=torch.float32, device=loss.device).detach().reshape(())
    return value, None


def _items_or_none(items: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    return torch.full((), -1.0, device=device) if items is None else items.float().reshape(()).to(device)
