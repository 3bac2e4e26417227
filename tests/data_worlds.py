"""Batches of any structure and iterable data: run functions shared by the reference and spawned worlds."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

import unison

N_SAMPLES = 96
GLOBAL_BATCH = 16
ACCUMULATE = 2
EPOCHS = 2  # 6 steps per epoch of map-style data, 12 steps in all
RESUME_AT = 5  # mid-epoch, mid-stream


class NestedDataset(Dataset):
    """Samples ``{"x": float[8], "y": float[1], "meta": {"ids": long[5], "w": float scalar}}``."""

    def __init__(self, n: int = N_SAMPLES, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.ids = torch.randint(0, 10, (n, 5), generator=g)
        self.w = torch.rand(n, generator=g) + 0.5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "meta": {"ids": self.ids[i], "w": self.w[i]}}


class NestedStream(IterableDataset):
    """The same samples as a stream, in an order that changes with the epoch (``set_epoch``)."""

    def __init__(self, n: int = N_SAMPLES) -> None:
        self.data = NestedDataset(n)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(100 + self.epoch))
        for i in order.tolist():
            yield self.data[i]


class NestedModel(torch.nn.Module):
    """Takes float features and integer token ids (which must stay integer)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(12, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert not ids.is_floating_point(), "token ids must stay integer"
        return self.head(torch.tanh(self.lin(torch.cat([x, self.emb(ids).mean(1)], dim=-1))))


def nested_step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    out = model(batch["x"], batch["meta"]["ids"])
    return ((out - batch["y"]).pow(2).squeeze(-1) * batch["meta"]["w"]).mean()


def build_model() -> torch.nn.Module:
    return NestedModel()


def source(kind: str) -> Any:
    return NestedDataset() if kind == "map" else NestedStream()


def fit(
    strategy: str,
    kind: str,
    workers: int,
    *,
    max_steps: int | None = None,
    checkpoint_dir: str | None = None,
    ckpt_path: str | None = None,
    model: Any = build_model,
) -> dict[str, Any]:
    settings: dict[str, Any] = {"max_steps": max_steps} if max_steps is not None else {"max_epochs": EPOCHS}
    trainer = unison.Trainer(
        strategy=strategy,
        global_batch_size=GLOBAL_BATCH,
        accumulate_grad_batches=ACCUMULATE,
        num_workers=workers,
        checkpoint_dir=checkpoint_dir,
        grad_clip_norm=1.0,
        seed=3,
        **settings,
    )
    epochs: list[tuple[str, int]] = []

    class Epochs:
        @unison.hookimpl
        def unison_on_train_epoch_start(self, epoch: int) -> None:
            epochs.append(("start", epoch))

        @unison.hookimpl
        def unison_on_train_epoch_end(self, epoch: int) -> None:
            epochs.append(("end", epoch))

    trainer.pm.register(Epochs())
    progress = trainer.fit(
        model,
        source(kind),
        training_step=nested_step,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        ckpt_path=ckpt_path,
    )
    return {
        "state": trainer.full_state_dict(),
        "losses": [h.loss for h in progress.history],
        "steps": [h.step for h in progress.history],
        "epochs": epochs,
        "global_step": progress.global_step,
    }


def _shared_dir(prefix: str) -> str:
    """A directory every rank agrees on (rank 0 makes it, the name is broadcast)."""
    name = (
        [tempfile.mkdtemp(prefix=prefix)]
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        else [None]
    )
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(name, src=0)
    return name[0]


def data_runs(strategy: str, workers: tuple[int, ...] = (0, 2)) -> dict[str, Any]:
    """Map-style and iterable nested batches, with each worker count, plus save -> resume."""
    out: dict[str, Any] = {}
    for kind in ("map", "iterable"):
        for w in workers:
            out[f"{kind}-{w}"] = fit(strategy, kind, w)
            root = _shared_dir(f"unison-data-{kind}-{w}-")
            fit(strategy, kind, w, max_steps=RESUME_AT, checkpoint_dir=root)
            resumed = fit(strategy, kind, w, checkpoint_dir=root, ckpt_path="last")
            out[f"{kind}-{w}-resumed"] = resumed
    return out


def per_rank_model() -> torch.nn.Module:
    """A model whose initial weights (and a buffer) depend on the rank that builds it."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.manual_seed(1000 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    # A buffer that differs per rank too: replicas must start from rank 0's.
    model[0].register_buffer("offset", torch.full((1,), float(rank)))
    return model


def desync_runs(strategies: tuple[str, ...]) -> dict[str, Any]:
    """Each strategy trains a model whose every rank built different weights (passed as a module)."""
    from helpers import regression_data

    out = {}
    for name in strategies:
        trainer = unison.Trainer(strategy=name, global_batch_size=16, accumulate_grad_batches=2, max_steps=6, seed=0)
        trainer.fit(
            per_rank_model(),
            regression_data(n=64),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        )
        out[name] = trainer.full_state_dict()
    return out


def rank0_init_reference() -> dict[str, torch.Tensor]:
    """What every replica must equal: rank 0's initial weights, trained by one process."""
    from helpers import regression_data

    torch.manual_seed(1000)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model[0].register_buffer("offset", torch.zeros(1))
    trainer = unison.Trainer(strategy="single", global_batch_size=16, accumulate_grad_batches=2, max_steps=6, seed=0)
    trainer.fit(
        model,
        regression_data(n=64),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
    )
    return trainer.full_state_dict()


def world_runs(strategies: tuple[str, ...], workers: tuple[int, ...], desync: tuple[str, ...]) -> dict[str, Any]:
    out = {name: data_runs(name, workers) for name in strategies}
    out["desync"] = desync_runs(desync)
    return out
