"""Peers: the same training in PyTorch Lightning and Hugging Face Accelerate (the ``bench`` extra), side
by side with unison, for ddp and fsdp (FSDP2).

All three train the workload on a 2-rank gloo world with accumulation and clipping,
in rounds whose order rotates. Lightning and Accelerate get the same global batches:
their DataLoader yields this rank's slice of each micro-batch in unison's order
(Lightning: ``use_distributed_sampler=False``, so it does not substitute its own
shuffling sampler; Accelerate: the loader is not prepared), and each divides each
micro-batch's loss by the accumulation count and clips by the global norm, as unison
does. Under fsdp each shards the workload's units (every ``Linear`` of the MLP, every
block of the language model) and the root with ``fully_shard``, as unison's fsdp does
here (Lightning: ``ModelParallelStrategy``'s ``configure_model``;
Accelerate: its FSDP2 plugin, which it applies on accelerators only: on CPU its
``MULTI_CPU`` state ignores the plugin and wraps DDP, so Accelerate has no fsdp row
here). The final weights of one round are compared with unison's, parameter by
parameter.

Lightning runs inside the world this module is given (it finds the process
group initialised and the launcher's variables set, and starts no processes of
its own), with logging, checkpointing, the progress bar and the model summary
off, like unison's run here.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.workload import Stamp, Workload, run_unison, stamp, steady_step_time


def run_lightning(w: Workload, strategy: str = "ddp") -> dict[str, Any]:
    import lightning as L

    rank, world = dist.get_rank(), dist.get_world_size()
    stamps: list[Stamp] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = w.model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return w.loss(self.net(x), y)

        def configure_model(self) -> None:
            if strategy != "fsdp":
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]  # FSDP2 on the data-parallel dim, units as unison's
            for layer in reversed(list(self.net.modules())):
                if type(layer).__name__ in w.shard_classes:
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return w.optimizer(self.parameters())

    class Stamps(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % w.accumulate == 0:  # the optimizer stepped on this micro-batch
                stamps.append(stamp())

    module = Module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy="ddp" if strategy == "ddp" else _model_parallel(world),
        max_steps=w.steps,
        accumulate_grad_batches=w.accumulate,
        gradient_clip_val=w.clip,
        gradient_clip_algorithm="norm",
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Stamps()],
        num_sanity_val_steps=0,
    )
    env = dict(os.environ)
    try:
        trainer.fit(module, train_dataloaders=w.loader(world, rank))
    finally:
        # Lightning rewrites launcher variables of this process (WORLD_SIZE among
        # them) during fit; the next contender reads them, so they are restored.
        changed = {k: (env.get(k), v) for k, v in os.environ.items() if env.get(k) != v}
        changed.update({k: (v, None) for k, v in env.items() if k not in os.environ})
        os.environ.clear()
        os.environ.update(env)
    if not dist.is_initialized():
        raise RuntimeError("Lightning destroyed the process group of the world it was given")
    state = {k: _full(v) for k, v in module.net.state_dict().items()}
    return {"stamps": stamps, "state": state, "env_changed": changed}


def _model_parallel(world: int) -> Any:
    """Lightning's FSDP2 strategy (``ModelParallelStrategy``), every rank a data-parallel replica."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


def _full(value: torch.Tensor) -> torch.Tensor:
    """A state entry whole on this rank (a DTensor shard gathered: a collective)."""
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().clone()


#: Why Accelerate has no fsdp row on CPU: measured with accelerate 1.16, its ``MULTI_CPU`` state ignores the
#: FSDP plugin and ``prepare`` wraps the model in DistributedDataParallel.
ACCELERATE_FSDP_ON_CPU = (
    "Accelerate applies its FSDP plugin on accelerators only: on CPU (its MULTI_CPU state) it ignores the "
    "plugin and prepare() wraps DistributedDataParallel, so an fsdp row would measure ddp"
)


def run_accelerate(w: Workload, strategy: str) -> dict[str, Any]:
    """The same training with Hugging Face Accelerate: ``Accelerator.prepare``, ``accumulate``, ``backward``
    and ``clip_grad_norm_`` as its documentation writes the loop; ``fsdp`` through its FSDP2 plugin."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    rank, world = dist.get_rank(), dist.get_world_size()
    # One Accelerator per run in this process (its state is a process-wide singleton); the process
    # group stays (Accelerate joins the one it finds).
    AcceleratorState._reset_state(reset_partial_state=True)
    plugin = None
    if strategy == "fsdp":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            reshard_after_forward=True,
            # Its default wraps the root alone (one unit: a third of the collectives here); the same units
            # as unison's and Lightning's runs.
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=list(w.shard_classes),
        )
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=w.accumulate, fsdp_plugin=plugin)
    if plugin is not None and accelerator.distributed_type is not DistributedType.FSDP:
        AcceleratorState._reset_state(reset_partial_state=True)
        return {"unavailable": ACCELERATE_FSDP_ON_CPU}
    model = w.model()
    optimizer = w.optimizer(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    stamps: list[Stamp] = []
    batches = iter(w.loader(world, rank))  # not prepared: unison's slices of the same global batches
    for _ in range(w.steps):
        for _ in range(w.accumulate):
            x, y = next(batches)
            with accelerator.accumulate(model):
                accelerator.backward(w.loss(model(x), y))  # divided by the accumulation count
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), w.clip)
                optimizer.step()
                optimizer.zero_grad()
        stamps.append(stamp())
    state = {k: _full(v) for k, v in accelerator.unwrap_model(model).state_dict().items()}
    AcceleratorState._reset_state(reset_partial_state=True)
    return {"stamps": stamps, "state": state}


#: The contenders of a peer round, and the strategies they train.
CONTENDERS = ("unison", "lightning", "accelerate")
PEER_STRATEGIES = ("ddp", "fsdp")


def world_peer(w: Workload, rounds: int, strategies: tuple[str, ...] = PEER_STRATEGIES) -> dict[str, Any]:
    """Run on every rank of a 2-rank world: unison, Lightning and Accelerate, each strategy, in rounds whose
    order rotates (every contender first, second and third as often)."""
    import logging

    # Lightning announces its devices and strategy on every fit; the table says it once.
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    initial = w.model().state_dict()
    out: dict[str, Any] = {}
    for strategy in strategies:
        times: dict[str, list[float]] = {who: [] for who in CONTENDERS}
        states: dict[str, dict[str, torch.Tensor]] = {}
        env_changes: dict[str, Any] = {}
        unavailable: dict[str, str] = {}
        for r in range(rounds):
            order = CONTENDERS[r % 3 :] + CONTENDERS[: r % 3]
            for who in order:
                dist.barrier()
                if who == "unison":
                    run = run_unison(w, strategy)
                    states[who] = run["trainer"].full_state_dict()
                elif who == "lightning":
                    run = run_lightning(w, strategy)
                    states[who] = run["state"]
                    env_changes = run["env_changed"]
                else:
                    run = run_accelerate(w, strategy)
                    if "unavailable" in run:
                        unavailable[who] = run["unavailable"]
                        continue
                    states[who] = run["state"]
                times[who].append(steady_step_time(run["stamps"], w.warmup))
        diffs = {
            who: max(float((states["unison"][k] - states[who][k]).abs().max()) for k in states["unison"])
            for who in CONTENDERS[1:]
            if who in states
        }
        moved = max(float((states["unison"][k] - v).abs().max()) for k, v in initial.items())
        out[strategy] = {
            "times": times,
            "max_abs_weight_diff": diffs,
            "max_abs_weight_change": moved,
            "lightning_env_changes": env_changes,
            "unavailable": unavailable,
        }
    return out
