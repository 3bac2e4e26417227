"""What the 2-rank gloo world of tests/test_apex_distributed.py runs: every apex scenario in one process group.

Each run returns what the test compares with the single-process reference
(computed in the test's own process): the canonical state, the per-step
numbers, and for the stand-in strategy the stand-in's call log with the
trainer's phases marked in it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import apex_standin
import apex_standin.plugin as standin_plugin
import unison

from helpers import mlp, regression_data

STANDIN = standin_plugin.STANDIN


def overflow_data() -> torch.utils.data.TensorDataset:
    """Regression data where one sample overflows fp16 inside the model (a skipped step)."""
    x, y = regression_data().tensors
    x = x.clone()
    x[3] = 7e4  # beyond fp16's max (65504) after the first Linear
    return torch.utils.data.TensorDataset(x, y)


class TiedMLP(torch.nn.Module):
    """``head(tanh(decoder(tanh(encoder(x)))))`` with ``decoder.weight is encoder.weight``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.decoder, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        self.decoder.weight = self.encoder.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.decoder(torch.tanh(self.encoder(x)))))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def adam_l2(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)


def fused_adam(params: Any) -> torch.optim.Optimizer:
    from apex.optimizers import FusedAdam  # the stand-in, installed under apex's name

    return FusedAdam(params, lr=1e-2, weight_decay=0.01)


def fused_lamb(params: Any) -> torch.optim.Optimizer:
    from apex.optimizers import FusedLAMB

    return FusedLAMB(params, lr=1e-2, weight_decay=0.01)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": adamw,
    "adam_l2": adam_l2,
    "fused_adam": fused_adam,
    "fused_lamb": fused_lamb,
}


class OptimizerProbe:
    """A callback that marks the trainer's phases in the stand-in's call log and keeps the log at fit end."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.init_kwargs: dict[str, Any] = {}
        self.buckets = 0
        self.factory_steps = 0

    def _mark(self, trainer: Any, name: str, **args: Any) -> None:
        calls = getattr(trainer.strategy.optimizer, "calls", None)
        if calls is not None:
            calls.append((f"trainer:{name}", args))

    @unison.hookimpl
    def unison_on_train_step_start(self, trainer, step):
        self._mark(trainer, "step_start", step=step)

    @unison.hookimpl
    def unison_on_after_backward(self, trainer, step):
        self._mark(trainer, "after_backward", step=step)

    @unison.hookimpl
    def unison_on_before_optimizer_step(self, trainer, step, grad_norm):
        self._mark(trainer, "before_optimizer_step", step=step)

    @unison.hookimpl
    def unison_on_after_optimizer_step(self, trainer, step, skipped):
        self._mark(trainer, "after_optimizer_step", step=step, skipped=skipped)

    @unison.hookimpl
    def unison_on_fit_end(self, trainer):
        optimizer = trainer.strategy.optimizer
        if hasattr(optimizer, "calls"):
            self.calls = list(optimizer.calls)
            self.buckets = len(optimizer.state["buckets"])
            self.init_kwargs = {
                k: v if isinstance(v, (bool, int, float, str, tuple, type(None))) else repr(v)
                for k, v in optimizer.init_kwargs.items()
            }
            self.optimizer_class = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
            self.groups = [
                {k: v for k, v in g.items() if k != "params"} | {"params": len(g["params"])}
                for g in optimizer.param_groups
            ]


def run(
    strategy: str = STANDIN,
    *,
    optimizer: str = "adamw",
    data: Any = None,
    model: Any = None,
    scheduler: bool = True,
    ckpt_path: Any = None,
    options: dict[str, Any] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Train like tests/helpers.train (accumulation 4, clipping 0.5 that clips, StepLR, 20 steps).

    Returns what the tests compare, on every rank.
    """
    settings = {
        "accumulate_grad_batches": 4,
        "global_batch_size": 32,
        "max_steps": 20,
        "grad_clip_norm": 0.5,
        **settings,
    }
    probe = OptimizerProbe()
    pm = unison.PluginManager(plugins=[standin_plugin])
    trainer = unison.Trainer(
        strategy=strategy, strategy_options=options or {}, plugin_manager=pm, callbacks=[probe], **settings
    )

    def make(params: Any) -> torch.optim.Optimizer:
        built = OPTIMIZERS[optimizer](params)
        built.register_step_post_hook(lambda *_: setattr(probe, "factory_steps", probe.factory_steps + 1))
        return built

    progress = trainer.fit(
        model if model is not None else mlp(),
        data if data is not None else regression_data(),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=make,
        lr_scheduler=(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5)) if scheduler else None,
        ckpt_path=ckpt_path,
    )
    return {
        "state": trainer.full_state_dict(),
        "history": [h.as_dict() for h in progress.history],
        "optimizer_steps": progress.optimizer_steps,
        "scheduler_steps": progress.scheduler_steps,
        "skipped_steps": progress.skipped_steps,
        "calls": probe.calls,
        "buckets": probe.buckets,
        "init_kwargs": probe.init_kwargs,
        "factory_steps": probe.factory_steps,
        "optimizer_class": getattr(probe, "optimizer_class", None),
        "groups": getattr(probe, "groups", None),
    }


def _shared_tmpdir(prefix: str) -> str:
    root = [tempfile.mkdtemp(prefix=prefix) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(root)
    return root[0]


def hooks_released_after_fit() -> dict[str, Any]:
    """After fit, a plain backward on the trained module leaves its gradients in param.grad."""
    model = mlp()
    pm = unison.PluginManager(plugins=[standin_plugin])
    unison.Trainer(strategy=STANDIN, plugin_manager=pm, global_batch_size=8, max_steps=2).fit(
        model, regression_data(n=64), loss_fn=torch.nn.functional.mse_loss, optimizer=adamw
    )
    x, y = regression_data(n=8).tensors
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {"grads_kept": all(p.grad is not None for p in model.parameters())}


def standin_world() -> dict[str, Any]:
    """Every scenario of tests/test_apex_distributed.py, on each rank."""
    apex_standin.install()  # for the fused optimizers the factories import under apex's names
    out: dict[str, Any] = {}
    out["fp32"] = run()
    out["no_clip_accumulate_1"] = run(grad_clip_norm=None, accumulate_grad_batches=1, max_steps=4)
    out["accumulate_1"] = run(accumulate_grad_batches=1, max_steps=3)
    out["redundant"] = run(options={"distributed_size": 1})
    out["big_bucket"] = run(options={"bucket_cap_mb": 1.0, "overlap_grad_sync": False})
    out["adam_l2"] = run(optimizer="adam_l2")
    out["tied"] = run(model=TiedMLP())
    out["fused_adam"] = run(optimizer="fused_adam")
    out["bf16-mixed"] = run(precision="bf16-mixed")
    out["16-mixed"] = run(precision="16-mixed")
    out["overflow"] = run(precision="16-mixed", data=overflow_data(), max_steps=8)
    # apex's fused optimizers as the optimizer of another strategy.
    out["ddp_fused_adam"] = run("ddp", optimizer="fused_adam")
    out["ddp_fused_lamb"] = run("ddp", optimizer="fused_lamb")
    # Resume: 10 steps with a checkpoint, then to 20; and across ddp both ways.
    root = _shared_tmpdir("unison-apex-ckpt-")
    run(max_steps=10, checkpoint_dir=root)
    out["resumed"] = run(max_steps=20, checkpoint_dir=root, ckpt_path="last")
    step10 = Path(root) / "step-00000010"
    out["ddp_from_standin"] = run("ddp", ckpt_path=step10)
    ddp_root = _shared_tmpdir("unison-apex-ddp-ckpt-")
    run("ddp", max_steps=10, checkpoint_dir=ddp_root)
    out["standin_from_ddp"] = run(ckpt_path=Path(ddp_root) / "step-00000010")
    out["ckpt"] = str(step10)
    out["tmp_dirs"] = [root, ddp_root]
    out["hooks"] = hooks_released_after_fit()
    return out
