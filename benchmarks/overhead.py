"""Trainer overhead: unison `single` against a hand-written loop, same model and batches.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py [--steps N]``.
Prints steps/s of both and their ratio. Both run in this process, interleaved
over several repeats, and the best repeat of each is compared, so machine load
affects both alike.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import TensorDataset

import unison
from unison.data import BatchPlan, collate


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)
    )


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def hand_loop(steps: int, accumulate: int, batch: int) -> float:
    m, ds = model(), data()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    plan = BatchPlan(len(ds), batch, accumulate, 1, 0, seed=0)
    start = time.perf_counter()
    for step in range(steps):
        for idx in plan.local_micro_indices(step):
            x, y = collate(ds, idx)
            (torch.nn.functional.mse_loss(m(x), y) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def unison_loop(steps: int, accumulate: int, batch: int) -> float:
    trainer = unison.Trainer(
        strategy="single",
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        global_batch_size=batch,
        grad_clip_norm=1.0,
        log_every_n_steps=10**9,
    )
    start = time.perf_counter()
    trainer.fit(
        model(), data(), loss_fn=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hand, uni = [], []
    for _ in range(args.repeats):
        hand.append(hand_loop(args.steps, 4, 64))
        uni.append(unison_loop(args.steps, 4, 64))
    h, u = min(hand), min(uni)
    print(f"hand-written: {args.steps / h:8.1f} steps/s")
    print(f"unison single: {args.steps / u:7.1f} steps/s")
    print(f"unison / hand-written time ratio: {u / h:.3f}")


if __name__ == "__main__":
    main()
