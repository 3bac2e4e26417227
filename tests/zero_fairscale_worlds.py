"""What the 2-rank worlds of tests/test_torch_zero_fairscale.py run.

Every scenario of one strategy in one process group.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import torch

import unison

from helpers import mlp, overflow_data, regression_data, train


def _shared_tmpdir(prefix: str) -> str:
    """A directory made by rank 0 and known to every rank."""
    root = [tempfile.mkdtemp(prefix=prefix) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(root)
    return root[0]


class FootprintProbe:
    """Reads the strategy's memory footprint while fit still holds the optimizer."""

    def __init__(self) -> None:
        self.footprint: dict[str, int] = {}

    @unison.hookimpl
    def unison_on_fit_end(self, trainer):
        self.footprint = trainer.strategy.memory_footprint()


def footprint(strategy: str) -> dict[str, int]:
    """Per-rank bytes after 2 AdamW steps on an MLP whose tensors split evenly over 2 ranks.

    32x32 weights and 32-element biases: a per-tensor partition can give each
    rank half of the optimizer state (a 1024-weight layer each).
    """
    probe = FootprintProbe()
    trainer = unison.Trainer(strategy=strategy, callbacks=[probe], global_batch_size=8, max_steps=2)
    trainer.fit(
        mlp(d=32, hidden=32),
        regression_data(n=64, d=32),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    return probe.footprint


def precision_runs(strategy: str, precisions: tuple[str, ...]) -> dict[str, Any]:
    """The same run under each trainer-applied precision (plus a forced fp16 overflow)."""
    out = {p: train(strategy, precision=p) for p in precisions}
    if "16-mixed" in precisions:
        out["overflow"] = train(strategy, precision="16-mixed", data=overflow_data(), max_steps=8)
    return out


def factory_optimizer_steps(strategy: str) -> dict[str, int]:
    """How often the optimizer the user's factory returned really stepped, vs the trainer's count."""
    built: list[torch.optim.Optimizer] = []
    steps = [0]

    def make(params):
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
        built.append(optimizer)
        return optimizer

    trainer = unison.Trainer(strategy=strategy, global_batch_size=8, max_steps=3)
    progress = trainer.fit(mlp(), regression_data(n=64), loss_fn=torch.nn.functional.mse_loss, optimizer=make)
    return {"factory_calls": len(built), "steps": steps[0], "trainer_steps": progress.optimizer_steps}


def parity_and_resume(strategy: str) -> dict[str, Any]:
    """fp32 parity run, save at 10 -> resume to 20, and resume across ddp in both directions."""
    out: dict[str, Any] = {"fp32": train(strategy)}
    # Validation runs through the wrapper's forward too (every sample once, reduced over ranks).
    out["val"] = train(strategy, max_steps=4, val=regression_data(n=72, seed=5), val_every_n_steps=2)
    root = _shared_tmpdir(f"unison-{strategy}-ckpt-")
    train(strategy, max_steps=10, checkpoint_dir=root)
    out["resumed"] = train(strategy, max_steps=20, checkpoint_dir=root, ckpt_path="last")
    step10 = Path(root) / "step-00000010"
    # This backend's checkpoint under ddp, and a ddp checkpoint under this backend.
    out["ddp_from_ckpt"] = train("ddp", max_steps=20, ckpt_path=step10)
    ddp_root = _shared_tmpdir("unison-ddp-ckpt-")
    train("ddp", max_steps=10, checkpoint_dir=ddp_root)
    out["from_ddp_ckpt"] = train(strategy, max_steps=20, ckpt_path=Path(ddp_root) / "step-00000010")
    out["ckpt"] = str(step10)
    out["tmp_dirs"] = [root, ddp_root]
    out["factory_steps"] = factory_optimizer_steps(strategy)
    return out


def torch_zero_world() -> dict[str, Any]:
    out = parity_and_resume("torch_zero")
    out.update(precision_runs("torch_zero", ("bf16-mixed", "16-mixed")))
    out["footprint"] = {name: footprint(name) for name in ("torch_zero", "ddp")}
    out["footprint_default_mlp"] = train_footprint_default("torch_zero")
    return out


def train_footprint_default(strategy: str) -> dict[str, int]:
    """The footprint on the tests' default MLP (8->32->32->1: one 32x32 layer dominates)."""
    probe = FootprintProbe()
    trainer = unison.Trainer(strategy=strategy, callbacks=[probe], global_batch_size=8, max_steps=2)
    trainer.fit(
        mlp(),
        regression_data(n=64),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    return probe.footprint


def fairscale_oss_world() -> dict[str, Any]:
    out = parity_and_resume("fairscale_oss")
    out.update(precision_runs("fairscale_oss", ("bf16-mixed", "16-mixed")))
    out["footprint"] = footprint("fairscale_oss")
    return out


def upstream_sdp_loop(zero_grad_through: str, steps: int = 20, accumulate: int = 4) -> dict[str, torch.Tensor]:
    """fairscale's documented OSS + ShardedDataParallel loop, by hand, on helpers.train's batches.

    ``zero_grad_through="optimizer"`` is the usual ``optimizer.zero_grad()``
    (``set_to_none=True`` by default since torch 2.0); ``"model"`` zeroes
    through ``ShardedDataParallel.zero_grad``.
    """
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    x, y = regression_data().tensors
    model = mlp()
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    # Same global batches as the trainer (shuffle=True): read them from a BatchPlan.
    from unison.data.plan import BatchPlan

    plan = BatchPlan(
        dataset_size=len(x),
        global_batch_size=32,
        accumulate_grad_batches=accumulate,
        data_parallel_size=world,
        data_parallel_rank=rank,
        seed=0,
        shuffle=True,
    )
    for step in range(steps):
        micro = plan.local_micro_indices(step)
        for i, idx in enumerate(micro):
            idx = torch.as_tensor(idx)
            ctx = sdp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext()
            with ctx:
                (torch.nn.functional.mse_loss(sdp(x[idx]), y[idx]) / len(micro)).backward()
        optimizer.clip_grad_norm(0.5)
        optimizer.step()
        scheduler.step()
        if zero_grad_through == "optimizer":
            optimizer.zero_grad()
        else:
            sdp.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fairscale_sdp_world() -> dict[str, Any]:
    out = parity_and_resume("fairscale_sdp")
    out.update(precision_runs("fairscale_sdp", ("bf16-mixed", "16-mixed")))
    out["footprint"] = footprint("fairscale_sdp")
    out["upstream_optimizer_zero_grad"] = upstream_sdp_loop("optimizer")
    out["upstream_model_zero_grad"] = upstream_sdp_loop("model")
    out["upstream_optimizer_zero_grad_no_accumulation"] = upstream_sdp_loop("optimizer", accumulate=1)
    out["upstream_model_zero_grad_no_accumulation"] = upstream_sdp_loop("model", accumulate=1)
    return out
