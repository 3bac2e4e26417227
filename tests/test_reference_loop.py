"""`single` equals a hand-written PyTorch loop on the same global batches.

This anchors the whole conformance chain: every strategy is compared with
`single`, and `single` is compared here with plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch

import unison
from unison.data.plan import BatchPlan

from helpers import max_abs_diff, mlp, regression_data, train


def hand_written(steps=20, accumulate=4, global_batch=32, clip=0.5, lr=1e-2):
    torch.manual_seed(0)
    model = mlp()
    data = regression_data()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    plan = BatchPlan(len(data), global_batch, accumulate, 1, 0, seed=0)
    post_clip = []
    for step in range(steps):
        for idx in plan.local_micro_indices(step):
            x, y = data[idx]
            (torch.nn.functional.mse_loss(model(x), y) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        post_clip.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        opt.step()
        sched.step()
        opt.zero_grad()
    return model.state_dict(), post_clip


class PostClipNorm:
    def __init__(self):
        self.norms = []

    @unison.hookimpl
    def unison_on_before_optimizer_step(self, trainer, grad_norm):
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        self.norms.append((grad_norm, float(torch.nn.utils.get_total_norm(grads))))


def test_single_equals_hand_written_loop():
    expected, _ = hand_written()
    got = train("single")
    assert max_abs_diff(got["state"], expected) <= 1e-6


def test_clipping_really_clips_to_the_global_norm():
    recorder = PostClipNorm()
    trainer = unison.Trainer(
        strategy="single",
        callbacks=[recorder],
        accumulate_grad_batches=4,
        global_batch_size=32,
        max_steps=10,
        grad_clip_norm=0.5,
    )
    trainer.fit(
        mlp(),
        regression_data(),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    clipped = [(pre, post) for pre, post in recorder.norms if pre > 0.5]
    assert clipped, "the scenario must clip"
    for pre, post in recorder.norms:
        assert post == pytest.approx(min(pre, 0.5), rel=1e-4)
