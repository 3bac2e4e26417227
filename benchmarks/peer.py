"""Peer: the same ddp training in PyTorch Lightning (the ``bench`` extra), side by side with unison.

Both train the workload on a 2-rank gloo world with accumulation and clipping,
alternated round by round. Lightning gets the same global batches: its
DataLoader yields this rank's slice of each micro-batch in unison's order
(``use_distributed_sampler=False``, so Lightning does not substitute its own
shuffling sampler), and it divides each micro-batch's loss by the accumulation
count and clips by the global norm, as unison does. The final weights of one
round are compared parameter by parameter.

Lightning runs inside the world this module is given (it finds the process
group initialised and the launcher's variables set, and starts no processes of
its own), with logging, checkpointing, the progress bar and the model summary
off, like unison's run here.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.workload import Workload, run_unison, steady_step_time


def run_lightning(w: Workload) -> dict[str, Any]:
    import lightning as L

    rank, world = dist.get_rank(), dist.get_world_size()
    stamps: list[float] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = w.model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return w.loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return w.optimizer(self.parameters())

    class Stamps(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % w.accumulate == 0:  # the optimizer stepped on this micro-batch
                stamps.append(time.perf_counter())

    module = Module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy="ddp",
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
    state = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    return {"stamps": stamps, "state": state, "env_changed": changed}


def world_peer(w: Workload, rounds: int) -> dict[str, Any]:
    """Run on every rank of a 2-rank world: alternated unison ddp / Lightning ddp rounds."""
    import logging

    # Lightning announces its devices and strategy on every fit; the table says it once.
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    times: dict[str, list[float]] = {"unison": [], "lightning": []}
    states: dict[str, dict[str, torch.Tensor]] = {}
    env_changes: dict[str, Any] = {}
    for r in range(rounds):
        for who in ("lightning", "unison") if r % 2 == 0 else ("unison", "lightning"):
            dist.barrier()
            if who == "unison":
                out = run_unison(w, "ddp")
                states[who] = out["trainer"].full_state_dict()
            else:
                out = run_lightning(w)
                states[who] = out["state"]
                env_changes = out["env_changed"]
            times[who].append(steady_step_time(out["stamps"], w.warmup))
    diff = max(float((states["unison"][k] - states["lightning"][k]).abs().max()) for k in states["unison"])
    moved = max(float((states["unison"][k] - v).abs().max()) for k, v in w.model().state_dict().items())
    return {
        "times": times,
        "max_abs_weight_diff": diff,
        "max_abs_weight_change": moved,
        "lightning_env_changes": env_changes,
    }
