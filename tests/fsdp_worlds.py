"""What one 2-rank world runs for tests/test_fsdp.py: every scenario of one FSDP strategy."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import unison

from helpers import adamw, fit, mlp, overflow_data, regression_data, train


class TiedMLP(torch.nn.Module):
    """An MLP whose third layer reuses the first layer's weight (tied), plus an fp32 buffer."""

    def __init__(self, d: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(d, d)
        self.mid = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, d, bias=False)
        self.out.weight = self.inp.weight  # tied: one parameter reached from two modules
        self.head = torch.nn.Linear(d, 1)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x) + self.shift)
        h = torch.tanh(self.mid(h))
        return self.head(torch.tanh(self.out(h)))


class AttentionNet(torch.nn.Module):
    """Each 8-feature sample as 2 tokens of 4 through an ``nn.MultiheadAttention`` (reads ``out_proj.weight``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(4, 8)
        # No in-projection bias: the key bias has a zero gradient in exact arithmetic, which AdamW
        # turns into lr-sized steps driven by rounding noise (a numerics artefact, not a sharding one).
        self.attn = torch.nn.MultiheadAttention(8, 2, bias=False, batch_first=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.view(x.shape[0], 2, 4))
        return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))


def wide_mlp(d: int = 32, hidden: int = 1024) -> torch.nn.Module:
    """About 1.09M parameters (the memory-footprint model)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(d, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    )


class ReduceScatterCounter:
    """Counts reduce-scatter collectives issued during each step's forward/backward.

    A real plugin: the torch profiler records every c10d collective the
    process group runs (gloo executes reduce-scatter through an all-reduce
    underneath, which is not counted separately). The window is
    ``step_start`` .. ``after_backward``, i.e. exactly the micro-steps, before
    the clip's own all-reduce.
    """

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._prof: Any = None

    @unison.hookimpl
    def unison_on_train_step_start(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()

    @unison.hookimpl
    def unison_on_after_backward(self) -> None:
        self._prof.__exit__(None, None, None)
        from unison.conformance.profiling import records

        names = collections.Counter(r.name for r in records(self._prof) if not r.redispatched)
        self.per_step.append(
            sum(n for name, n in names.items() if name.startswith("c10d::") and "reduce_scatter" in name)
        )


class Footprint:
    """Records the strategy's memory footprint after the first optimizer step (optimizer state exists)."""

    def __init__(self) -> None:
        self.value: dict[str, int] | None = None

    @unison.hookimpl
    def unison_on_train_step_end(self, trainer: Any) -> None:
        if self.value is None:
            self.value = trainer.strategy.memory_footprint()


class ScaleRecorder:
    @unison.hookimpl
    def unison_on_fit_end(self, trainer: Any) -> None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.scale = float(trainer.precision.scaler.get_scale())
        self.sharded = isinstance(trainer.precision.scaler, ShardedGradScaler)


def _fit(strategy: str, *callbacks: Any, model: torch.nn.Module, data: Any, **settings: Any) -> unison.Trainer:
    trainer = unison.Trainer(strategy=strategy, callbacks=list(callbacks), **settings)
    fit(trainer, model=model, data=data, optimizer=adamw())
    return trainer


def fsdp_scenarios(strategy: str, ckpt_root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Parity: 20 steps, accumulation 4, clipping at 0.5, StepLR (helpers.train).
    out["fp32"] = train(strategy)
    out["bf16-mixed"] = train(strategy, precision="bf16-mixed")
    out["16-mixed"] = train(strategy, precision="16-mixed")
    out["bf16-true"] = train(strategy, precision="bf16-true")
    # Every option off its default still trains like single.
    options = {"reshard_after_forward": False, "shard_module_classes": ["Linear"]}
    if strategy == "fsdp":  # fsdp1 refuses cpu_offload on a CPU device (tested in test_fsdp.py)
        options["cpu_offload"] = True
    out["options"] = train(strategy, record=False, strategy_options=options)
    # fp16 overflow on one rank's micro-batch: every rank skips the step and backs the scale off.
    scale = ScaleRecorder()
    trainer = unison.Trainer(
        strategy=strategy,
        callbacks=[scale],
        precision="16-mixed",
        accumulate_grad_batches=4,
        global_batch_size=32,
        max_steps=8,
        grad_clip_norm=0.5,
    )
    progress = trainer.fit(
        mlp(),
        overflow_data(),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5),
    )
    out["overflow"] = {
        "history": [h.as_dict() for h in progress.history],
        "optimizer_steps": progress.optimizer_steps,
        "scheduler_steps": progress.scheduler_steps,
        "state": trainer.full_state_dict(),
        "scale": scale.scale,
        "sharded_scaler": scale.sharded,
    }
    # Tied weights and a buffer: the default selection leaves the shared weight to the root.
    out["tied"] = train(strategy, model=TiedMLP(), max_steps=10)
    # ... and under the bf16 policy, where the fp32 buffer meets bf16 activations.
    out["tied-bf16"] = train(strategy, model=TiedMLP(), max_steps=10, precision="bf16-mixed", record=False)

    # nn.MultiheadAttention under the default unit selection (out_proj stays with the attention unit).
    out["attention"] = train(strategy, model=AttentionNet(), max_steps=10, record=False)

    # Save at step 10, resume to 20 (sharded DCP), against uninterrupted fp32.
    own = f"{ckpt_root}/{strategy}"
    train(strategy, max_steps=10, checkpoint_dir=own, record=False)
    out["resumed"] = train(strategy, max_steps=20, checkpoint_dir=own, ckpt_path="last")
    # A ddp checkpoint (full DCP) resumes under this strategy too.
    train("ddp", max_steps=10, checkpoint_dir=f"{ckpt_root}/ddp-for-{strategy}", record=False)
    out["from_ddp"] = train(
        strategy, max_steps=20, ckpt_path=f"{ckpt_root}/ddp-for-{strategy}/step-00000010", record=False
    )

    # Gradient sync: reduce-scatters per optimizer step with accumulation 1 and 4.
    counts = {}
    for accumulate in (1, 4):
        counter = ReduceScatterCounter()
        _fit(
            strategy,
            counter,
            model=mlp(),
            data=regression_data(),
            accumulate_grad_batches=accumulate,
            global_batch_size=32,
            max_steps=3,
        )
        counts[accumulate] = counter.per_step
    out["reduce_scatters"] = counts

    # Memory: local shards vs ddp's replicas of a ~1.09M-parameter model.
    wide = regression_data(n=64, d=32)
    footprints = {}
    for name in (strategy, "ddp"):
        fp = Footprint()
        _fit(name, fp, model=wide_mlp(), data=wide, global_batch_size=8, max_steps=1)
        footprints[name] = fp.value
    out["footprint"] = footprints
    out["n_params"] = sum(p.numel() for p in wide_mlp().parameters())
    return out
