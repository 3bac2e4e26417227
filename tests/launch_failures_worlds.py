"""A tiny training script that tests/test_launch_failures.py runs under ``unison run --nproc 2``, failing on cue.

    unison run --nproc 2 tests/launch_failures_worlds.py CASE

CASE is one of :data:`CASES`; every case fails on rank 1 only, except ``pipeline_refusal`` (every rank)
and ``ok`` (no failure). The model is a 2-layer MLP on 64 random samples, 6 steps.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch.utils.data import Dataset, TensorDataset

import unison

RANK = int(os.environ.get("RANK", "0"))


class _Raise:
    """Raises on rank 1 at the end of step 2 (a callback's own bug)."""

    @unison.hookimpl
    def unison_on_train_step_end(self, step):
        if RANK == 1 and step == 2:
            raise RuntimeError("callback bug on rank 1")


class _Kill:
    """SIGKILLs rank 1 at the end of step 2 (what the OOM killer does)."""

    @unison.hookimpl
    def unison_on_train_step_end(self, step):
        if RANK == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)


class _Stall:
    """Rank 1 exits with the watchdog's code at step 2, as a rank that found a stalled peer does."""

    @unison.hookimpl
    def unison_on_train_step_end(self, step):
        if RANK == 1 and step == 2:
            print("watchdog: rank 0 stopped making progress at step 2", file=sys.stderr, flush=True)
            os._exit(unison.errors.EXIT_STALLED)


class _DyingWorkerData(Dataset):
    """A map-style dataset whose DataLoader worker process exits on rank 1 at its first sample.

    Before it has sent any batch: a worker that dies while a batch it sent is still being fetched fails that
    fetch instead (multiprocessing's resource sharer: ``ConnectionResetError``), and which of the two happens
    depends on how loaded the machine is. Here the loader's own check reports the death every time.
    """

    def __init__(self, inner: TensorDataset) -> None:
        self.inner, self.served = inner, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if torch.utils.data.get_worker_info() is not None:  # counted in the worker process only
            self.served += 1
            if RANK == 1 and self.served == 1:
                os._exit(1)
        return self.inner[i]


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


class _NotSequential(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _loss_raising_on_rank_1(out, y, _calls=[0]):  # noqa: B006 - a call counter
    _calls[0] += 1
    if RANK == 1 and _calls[0] == 3:
        raise ValueError("loss exploded on rank 1")
    return torch.nn.functional.mse_loss(out, y)


def main(case: str) -> None:
    settings = dict(strategy="ddp", global_batch_size=8, max_steps=6, seed=0, progress="off", throughput=False)
    callbacks: list = []
    loss_fn = torch.nn.functional.mse_loss
    train = data()
    net = model
    if case == "config_rank1":
        if RANK == 1:
            settings["max_step"] = settings.pop("max_steps")  # the typo, on one rank only
    elif case == "raise_rank1":
        loss_fn = _loss_raising_on_rank_1
    elif case == "callback_rank1":
        callbacks.append(_Raise())
    elif case == "sigkill_rank1":
        callbacks.append(_Kill())
    elif case == "stall_rank1":
        callbacks.append(_Stall())
    elif case == "dataloader_exit":
        train = _DyingWorkerData(train)
        settings["num_workers"] = 1
    elif case == "pipeline_refusal":
        settings["strategy"] = "pipeline"
        net = _NotSequential
    elif case != "ok":
        raise SystemExit(f"unknown case {case!r}")
    trainer = unison.Trainer(callbacks=callbacks, **settings)
    trainer.fit(net, train, loss_fn=loss_fn, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


CASES = (
    "config_rank1",
    "raise_rank1",
    "callback_rank1",
    "sigkill_rank1",
    "stall_rank1",
    "dataloader_exit",
    "pipeline_refusal",
)

if __name__ == "__main__":
    main(sys.argv[1])
