"""The Hugging Face causal-LM example trained by any strategy (importable by spawned ranks)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import unison

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hf_causal_lm as example

STEPS = 8


def hf_run(strategy: str, **settings: Any) -> dict[str, Any]:
    train, val = example.build_datasets(seq_len=32, max_bytes=16_384, val_bytes=4_096)
    trainer = unison.Trainer(
        strategy=strategy,
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=STEPS,
        grad_clip_norm=1.0,
        seed=0,
        **settings,
    )
    progress = trainer.fit(
        example.build_model,
        train,
        training_step=example.training_step,
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
        val_dataset=val,
    )
    return {
        "state": trainer.full_state_dict(),
        "losses": [h.loss for h in progress.history],
        "tokens": [h.tokens for h in progress.history],
        "val": trainer.last_validation["val/loss"],
    }


def hf_world(strategies: tuple[str, ...]) -> dict[str, Any]:
    return {name: hf_run(name) for name in strategies}
