"""What one 2-rank DeepSpeed world runs for tests/test_deepspeed.py: every scenario in one process group.

DeepSpeed picks its accelerator at first import, so ``DS_ACCELERATOR=cpu`` is
set here, before anything imports deepspeed in a spawned rank.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from pathlib import Path
from typing import Any

import torch

import unison

from helpers import HookRecorder, mlp, regression_data

#: Partition every parameter under ZeRO-3, however small: DeepSpeed keeps
#: parameters under 1e5 elements whole by default, so a tiny MLP would never
#: exercise the gather paths (placeholders, grad norm, full state dict).
ZERO3_ALL_PARTITIONED = {"config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}

#: The memory model: ~2.1M parameters in two 1024x1024 layers.
MEMORY_WIDTH = 1024


class EngineProbe:
    """Reads the engine's own view after every optimizer step (a real plugin)."""

    def __init__(self) -> None:
        self.engine_norms: list[float | None] = []
        self.engine_lrs: list[float] = []
        self.shared_param_groups: list[bool] = []
        self.footprint: dict[str, int] | None = None

    @unison.hookimpl
    def unison_on_before_optimizer_step(self, trainer: Any) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            # The lr the engine is about to apply in this step.
            self.engine_lrs.append(float(engine.get_lr()[0]))

    @unison.hookimpl
    def unison_on_after_optimizer_step(self, trainer: Any) -> None:
        strategy = trainer.strategy
        engine = getattr(strategy, "engine", None)
        if engine is None:
            return
        norm = engine.get_global_grad_norm()  # None where the trainer clips and DeepSpeed measured no norm
        self.engine_norms.append(float(norm) if norm is not None else None)
        # The scheduler steps the client optimizer; the ZeRO optimizer must
        # update with the very same param_groups dicts.
        self.shared_param_groups.append(
            all(a is b for a, b in zip(engine.optimizer.param_groups, strategy.optimizer.param_groups))
        )

    @unison.hookimpl
    def unison_on_fit_end(self, trainer: Any) -> None:
        # Before teardown: the engine and its optimizer state still exist.
        self.footprint = trainer.strategy.memory_footprint()


def train(
    strategy: str, *, model: Any = None, data: Any = None, ckpt_path: Any = None, **settings: Any
) -> dict[str, Any]:
    """helpers.train's run (same defaults, model, data, optimizer, scheduler) plus the engine probe."""
    settings = {
        "accumulate_grad_batches": 4,
        "global_batch_size": 32,
        "max_steps": 20,
        "grad_clip_norm": 0.5,
        **settings,
    }
    recorder, probe = HookRecorder(), EngineProbe()
    trainer = unison.Trainer(strategy=strategy, callbacks=[recorder, probe], **settings)
    with trainer.pm.record_hook_calls() as monitored:
        progress = trainer.fit(
            model if model is not None else mlp(),
            data if data is not None else regression_data(),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5),
            ckpt_path=ckpt_path,
        )
    return {
        "state": trainer.full_state_dict(),
        "history": [h.as_dict() for h in progress.history],
        "optimizer_steps": progress.optimizer_steps,
        "scheduler_steps": progress.scheduler_steps,
        "hooks": recorder.calls,
        "monitored": monitored,
        "engine_norms": probe.engine_norms,
        "engine_lrs": probe.engine_lrs,
        "shared_param_groups": probe.shared_param_groups,
        "footprint": probe.footprint,
    }


def memory_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    w = MEMORY_WIDTH
    return torch.nn.Sequential(
        torch.nn.Linear(w, w), torch.nn.Tanh(), torch.nn.Linear(w, w), torch.nn.Tanh(), torch.nn.Linear(w, 1)
    )


def footprint(strategy: str, precision: str, options: dict[str, Any]) -> dict[str, int]:
    """Bytes per rank after one optimizer step (optimizer state exists) on the memory model."""
    run = train(
        strategy,
        model=memory_model(),
        data=regression_data(n=32, d=MEMORY_WIDTH),
        max_steps=1,
        accumulate_grad_batches=2,
        global_batch_size=8,
        precision=precision,
        strategy_options=options,
    )
    return run["footprint"]


#: Which stage resumes from which stage's checkpoint (through the canonical copy).
NEXT_STAGE = {"zero1": "zero2", "zero2": "zero3", "zero3": "zero1"}


def options_for(strategy: str) -> dict[str, Any]:
    return ZERO3_ALL_PARTITIONED if strategy == "zero3" else {}


def deepspeed_scenarios(strategy: str, single_checkpoint: str, checkpoint_dir: str) -> dict[str, Any]:
    """Every scenario of one ZeRO stage, in this rank's part of one 2-rank world.

    ``single_checkpoint`` is a step-10 checkpoint written by the single
    strategy; this world writes its own checkpoints under ``checkpoint_dir``
    (the test resumes single from them afterwards).
    """
    options = options_for(strategy)
    out: dict[str, Any] = {}
    out["fp32"] = train(strategy, strategy_options=options)
    out["bf16-mixed"] = train(strategy, precision="bf16-mixed", strategy_options=options)
    # ZeRO-Offload (and, on ZeRO-3, parameter offload) with the client optimizer.
    offload = {"offload_optimizer": "cpu", **({"offload_param": "cpu"} if strategy == "zero3" else {})}
    out["offload"] = train(strategy, strategy_options={**options, **offload}, max_steps=8)

    # Save at step 10 (the end of a 10-step run), resume to 20 from DeepSpeed's own files.
    train(strategy, max_steps=10, checkpoint_dir=checkpoint_dir, strategy_options=options)
    step10 = Path(checkpoint_dir) / "step-00000010"
    out["resumed"] = train(strategy, max_steps=20, ckpt_path=str(step10), strategy_options=options)
    out["checkpoint_files"] = sorted(
        str(p.relative_to(step10 / "state")) for p in (step10 / "state").rglob("*") if p.is_file()
    )
    # Cross-backend: from single's checkpoint (world 1, DCP), and another
    # ZeRO stage from this one's (through the canonical copy).
    out["from_single"] = train(strategy, max_steps=20, ckpt_path=single_checkpoint, strategy_options=options)
    other = NEXT_STAGE[strategy]
    out["other_stage"] = other
    out["from_other_stage"] = train(other, max_steps=20, ckpt_path=str(step10), strategy_options=options_for(other))

    # Memory: this stage and ddp on the same ~2.1M-parameter model.
    # DeepSpeed's default persistence threshold here: its 1024x1024 layers are
    # partitioned, its biases kept whole, as in real use.
    out["memory"] = {
        precision: {strategy: footprint(strategy, precision, {}), "ddp": footprint("ddp", precision, {})}
        for precision in ("32-true", "bf16-mixed")
    }
    out["parameters"] = sum(p.numel() for p in memory_model().parameters())
    return out
