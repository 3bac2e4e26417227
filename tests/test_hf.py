"""The Hugging Face example (dict batches, training_step form) under single, ddp, fsdp and zero2."""

from __future__ import annotations

import pytest
import torch

import unison
from unison.launch.torchrun import spawn

from helpers import max_abs_diff
from hf_worlds import STEPS, example, hf_run, hf_world

FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def reference() -> dict:
    return hf_run("single")


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return spawn(hf_world, 2, ("ddp", "fsdp", "zero2"), timeout=500)


def test_reference_trains(reference):
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # bytes: ln 256 = 5.5 at the start
    assert reference["tokens"] == [16 * 32] * STEPS  # the token rule reads attention_mask


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_example_matches_single(world, reference, strategy):
    for rank in world:
        run = rank[strategy]
        assert max_abs_diff(run["state"], reference["state"]) <= FP32_TOL
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert run["tokens"] == reference["tokens"]
        assert run["val"] == pytest.approx(reference["val"], rel=1e-5)


def test_pipeline_refuses_the_training_step_form_before_training(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    train, _ = example.build_datasets(seq_len=32, max_bytes=4_096)
    trainer = unison.Trainer(strategy="pipeline", global_batch_size=16, accumulate_grad_batches=2, max_steps=2)
    with pytest.raises(unison.DeclaredRefusal, match=r"training_step.*Pass loss_fn=\.\.\. with \(inputs, targets\)"):
        trainer.fit(
            example.build_model,
            train,
            training_step=example.training_step,
            optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
        )
    assert not torch.distributed.is_initialized()
