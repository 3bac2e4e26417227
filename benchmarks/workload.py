"""The workloads the benchmarks train, and the hand-written loops they are compared with.

Two workloads: :class:`Workload`, an MLP (an ``nn.Sequential`` of Linear
layers, so the pipeline can split it) whose steps take a few milliseconds, so
fixed per-step costs weigh heavily; and :class:`LMWorkload`, a byte-level
transformer (the tinylm example's blocks, widened; an ``nn.Sequential`` of
embedding, blocks and head) whose steps take 100-300 ms here, like a real
model's. Model, data and settings are shared: AdamW, accumulation over micro-batches,
clipping by the global norm, fixed data order (``shuffle=False``: global batch
``k`` is samples ``k*G .. k*G+G-1``, micro-batch ``m`` of it is cut into one
contiguous slice per data-parallel rank, exactly as unison cuts it).

Each hand-written loop uses its backend's API directly, the way its
documentation shows, and feeds the same micro-batches through a plain
``DataLoader`` (per-sample ``__getitem__`` and ``default_collate``, like
unison's own loader). Each returns the stamps taken after every optimizer
step (:func:`stamp`: the wall clock and this process's CPU time), so the
benchmark reads the steady-state step time from the same place for every
contender.

One module past 400 lines on purpose: the workloads and every hand-written loop
they are compared with sit together, so a reader checks both sides of each ratio
in one place.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

#: Strategies that shard with FSDP2 units: they get the same units as the hand-written fsdp loop.
FSDP2_FAMILY = ("fsdp", "hsdp", "fsdp_tp")


@dataclass(frozen=True)
class Workload:
    """What one timed run trains: the MLP."""

    #: The name in tables and ``--workload``; the ratio target (unison / the other) on this workload.
    name: ClassVar[str] = "mlp"
    target: ClassVar[float] = 1.03

    d_in: int = 64
    hidden: int = 512
    layers: int = 4
    samples: int = 8192
    global_batch: int = 64
    accumulate: int = 2
    clip: float = 0.5
    lr: float = 1e-3
    steps: int = 25
    warmup: int = 5

    def model(self) -> torch.nn.Sequential:
        torch.manual_seed(0)
        dims = [self.d_in] + [self.hidden] * (self.layers - 1)
        mods: list[torch.nn.Module] = []
        for a, b in itertools.pairwise(dims):
            mods += [torch.nn.Linear(a, b), torch.nn.Tanh()]
        mods.append(torch.nn.Linear(dims[-1], 1))
        model = torch.nn.Sequential(*mods)
        # fsdp_tp's plan (every other strategy ignores it): the Linears in colwise -> rowwise pairs, so the
        # activations between two pairs are whole on every tp rank.
        linears = [str(i) for i, m in enumerate(mods) if isinstance(m, torch.nn.Linear)]
        model.tp_plan = {name: ("colwise", "rowwise")[i % 2] for i, name in enumerate(linears[: len(linears) // 2 * 2])}
        return model

    def data(self) -> TensorDataset:
        g = torch.Generator().manual_seed(123)
        x = torch.randn(self.samples, self.d_in, generator=g)
        y = torch.tanh(x[:, :8]).sum(1, keepdim=True) + 0.1 * torch.randn(self.samples, 1, generator=g)
        return TensorDataset(x, y)

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model().parameters())

    def micro_indices(self, step: int, replicas: int, rank: int) -> list[list[int]]:
        """Rank ``rank``'s slice of each micro-batch of optimizer step ``step`` (unison's cut)."""
        start = step * self.global_batch
        per_micro = self.global_batch // self.accumulate
        per_rank = per_micro // replicas
        return [
            list(range(start + m * per_micro + rank * per_rank, start + m * per_micro + (rank + 1) * per_rank))
            for m in range(self.accumulate)
        ]

    def loader(self, replicas: int, rank: int) -> DataLoader:
        """The micro-batches a hand-written loop feeds, in unison's order, through a plain DataLoader."""
        sampler = [idx for step in range(self.steps) for idx in self.micro_indices(step, replicas, rank)]
        return DataLoader(self.data(), batch_sampler=sampler)

    def strategy_options(self, strategy: str) -> dict[str, Any] | None:
        """Options that make unison's backend set up as the hand-written loop does (FSDP's units)."""
        return {"shard_module_classes": list(self.shard_classes)} if strategy in FSDP2_FAMILY else None

    def unison_settings(self, **extra: Any) -> dict[str, Any]:
        return {
            "max_steps": self.steps,
            "global_batch_size": self.global_batch,
            "accumulate_grad_batches": self.accumulate,
            "grad_clip_norm": self.clip,
            "shuffle": False,
            "progress": "off",
            # Nothing logged inside the timed window: like the hand-written loops.
            "log_every_n_steps": 10**6,
            **extra,
        }

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr)

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, target)

    #: Class names of the submodules FSDP shards as their own unit, in both contenders.
    shard_classes: tuple[str, ...] = ("Linear",)

    def describe(self) -> str:
        """One line for the results: what the model is and how big."""
        return (
            f"MLP {self.d_in}-{'-'.join([str(self.hidden)] * (self.layers - 1))}-1 ({self.parameters():,} parameters), "
            f"global batch {self.global_batch} in {self.accumulate} micro-batches"
        )


class _Embed(torch.nn.Module):
    """Token and learned position embeddings (the first pipeline stage's layer)."""

    def __init__(self, vocab: int, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.randn(seq_len, d_model) * 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class _Block(torch.nn.Module):
    """A pre-norm causal self-attention and MLP block (the tinylm example's)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.attn = torch.nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(), torch.nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


@dataclass(frozen=True)
class LMWorkload(Workload):
    """A realistic step: a byte-level causal transformer on windows of the stdlib's source.

    The head is untied from the embedding so that the pipeline can split the
    model at any block boundary. Sizes chosen for 100-300 ms per optimizer
    step per rank here (one thread per rank).
    """

    name: ClassVar[str] = "lm"
    target: ClassVar[float] = 1.01

    vocab: int = 256
    d_model: int = 256
    heads: int = 4
    blocks: int = 4
    seq_len: int = 128
    samples: int = 2048
    global_batch: int = 8
    steps: int = 12
    warmup: int = 3
    shard_classes: tuple[str, ...] = ("_Block",)

    def model(self) -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            _Embed(self.vocab, self.d_model, self.seq_len),
            *(_Block(self.d_model, self.heads) for _ in range(self.blocks)),
            torch.nn.LayerNorm(self.d_model),
            torch.nn.Linear(self.d_model, self.vocab, bias=False),
        )

    def data(self) -> TensorDataset:
        import os
        from pathlib import Path

        need = self.samples * (self.seq_len + 1)
        text = b""
        for path in sorted(Path(os.__file__).parent.glob("*.py")):
            text += path.read_bytes()
            if len(text) >= need:
                break
        tokens = torch.frombuffer(bytearray(text[:need]), dtype=torch.uint8).long().view(self.samples, -1)
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    def describe(self) -> str:
        return (
            f"causal transformer, {self.blocks} blocks of d_model {self.d_model}, {self.heads} heads, sequences of "
            f"{self.seq_len} bytes ({self.parameters():,} parameters), global batch {self.global_batch} in "
            f"{self.accumulate} micro-batches"
        )


#: The workloads by name (``python -m benchmarks --workload``).
WORKLOADS: dict[str, type[Workload]] = {w.name: w for w in (Workload, LMWorkload)}


Stamp = tuple[float, float]


def stamp() -> Stamp:
    """Now, twice: the wall clock (``time.perf_counter``) and the CPU seconds this process has used.

    The CPU time counts every thread of the process (the training thread,
    autograd's, gloo's) and nothing of the time the process waited in a
    collective or was not scheduled: it measures the work a step asks for,
    where the wall clock also measures waiting and the machine's other load.
    """
    return time.perf_counter(), time.process_time()


def steady_step_time(stamps: list[Stamp], warmup: int) -> float:
    """Mean wall seconds per optimizer step after ``warmup`` steps, from stamps taken after each step."""
    return (stamps[-1][0] - stamps[warmup - 1][0]) / (len(stamps) - warmup)


def steady_step_cpu(stamps: list[Stamp], warmup: int) -> float:
    """Mean CPU seconds this process used per optimizer step after ``warmup`` steps."""
    return (stamps[-1][1] - stamps[warmup - 1][1]) / (len(stamps) - warmup)


# --------------------------------------------------------------------------- #
# unison
# --------------------------------------------------------------------------- #


def stamp_plugin() -> tuple[Any, list[Stamp]]:
    import unison

    stamps: list[Stamp] = []

    class Stamps:
        @unison.hookimpl
        def unison_on_train_step_end(self) -> None:
            stamps.append(stamp())

    return Stamps(), stamps


def run_unison(
    w: Workload,
    strategy: str,
    *,
    callbacks: tuple = (),
    strategy_options: dict | None = None,
    nonfinite: str = "raise",
    **extra: Any,
) -> dict[str, Any]:
    """Train with unison; return step stamps, the final state and the trainer."""
    import unison

    plugin, stamps = stamp_plugin()
    strategy_options = strategy_options or w.strategy_options(strategy)
    options = {"strategy_options": strategy_options} if strategy_options else {}
    trainer = unison.Trainer(
        strategy=strategy, callbacks=[plugin, *callbacks], nonfinite=nonfinite, **w.unison_settings(**options, **extra)
    )
    trainer.fit(w.model, w.data(), loss_fn=w.loss, optimizer=w.optimizer)
    return {"stamps": stamps, "trainer": trainer}


# --------------------------------------------------------------------------- #
# Hand-written loops, one per backend API
# --------------------------------------------------------------------------- #


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def hand_single(w: Workload) -> list[Stamp]:
    model = w.model()
    opt = w.optimizer(model.parameters())
    stamps = []
    batches = iter(w.loader(1, 0))
    for _ in range(w.steps):
        for _ in range(w.accumulate):
            x, y = next(batches)
            (w.loss(model(x), y) / w.accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(stamp())
    return stamps


def hand_ddp(w: Workload) -> list[Stamp]:
    from torch.nn.parallel import DistributedDataParallel

    rank, world = _world()
    model = DistributedDataParallel(w.model())
    opt = w.optimizer(model.parameters())
    stamps = []
    batches = iter(w.loader(world, rank))
    for _ in range(w.steps):
        for m in range(w.accumulate):
            x, y = next(batches)
            # Gradient all-reduce only on the last micro-batch of the step.
            with model.no_sync() if m < w.accumulate - 1 else contextlib.nullcontext():
                (w.loss(model(x), y) / w.accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(stamp())
    return stamps


def hand_fsdp(w: Workload) -> list[Stamp]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = _world()
    model = w.model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in reversed(list(model.modules())):
        if type(layer).__name__ in w.shard_classes:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = w.optimizer(model.parameters())
    stamps = []
    batches = iter(w.loader(world, rank))
    for _ in range(w.steps):
        for m in range(w.accumulate):
            x, y = next(batches)
            model.set_requires_gradient_sync(m == w.accumulate - 1)
            (w.loss(model(x), y) / w.accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)  # DTensor-aware: the global norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(stamp())
    return stamps


def deepspeed_config(w: Workload, stage: int, world: int) -> dict[str, Any]:
    """The DeepSpeed config unison generates for these settings (so both runs configure the engine alike),
    clipping as a DeepSpeed user does: by the engine, at ``gradient_clipping``, with its own norm (where
    unison clips with the trainer's norm instead, its config turns the engine's off)."""
    import unison

    trainer = unison.Trainer(strategy=f"zero{stage}", **w.unison_settings())
    config = trainer.strategy.build_config(trainer.settings, world)
    config["gradient_clipping"] = w.clip
    config["zero_optimization"].pop("compute_grad_norm", None)
    return config


def hand_deepspeed(w: Workload, stage: int) -> list[Stamp]:
    import os

    import deepspeed

    rank, world = _world()
    os.environ.setdefault("LOCAL_RANK", str(rank))
    model = w.model()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=w.optimizer(model.parameters()), config=deepspeed_config(w, stage, world)
    )
    stamps = []
    batches = iter(w.loader(world, rank))
    for _ in range(w.steps):
        for _ in range(w.accumulate):
            x, y = next(batches)
            # The engine divides by gradient_accumulation_steps, counts micro-steps,
            # and reduces, clips and updates at its boundary.
            engine.backward(w.loss(engine(x), y))
            engine.step()
        stamps.append(stamp())
    engine.destroy()
    return stamps


def hand_pipeline(w: Workload) -> list[Stamp]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, world = _world()
    stages = world  # one pipeline over the world
    model = w.model()
    children = list(model.children())
    # Split the Sequential by parameter count, as unison balances it.
    sizes = [sum(p.numel() for p in c.parameters()) for c in children]
    total, acc, cut = sum(sizes), 0, []
    for i, s in enumerate(sizes):
        acc += s
        if len(cut) < stages - 1 and acc >= total * (len(cut) + 1) / stages:
            cut.append(i + 1)
    bounds = [0, *cut, len(children)]
    mine = torch.nn.Sequential(*children[bounds[rank] : bounds[rank + 1]])
    stage = PipelineStage(mine, rank, stages, torch.device("cpu"))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return w.loss(out, target) / w.accumulate

    schedule = ScheduleGPipe(stage, w.accumulate, loss_fn=loss_fn, scale_grads=False)
    opt = w.optimizer(mine.parameters())
    stamps = []
    batches = iter(w.loader(1, 0))
    for _ in range(w.steps):
        micro = [next(batches) for _ in range(w.accumulate)]
        # The schedule re-splits one whole batch into the micro-batches.
        x, y = torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])
        if rank == 0:
            schedule.step(x)
        elif rank == stages - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        grads = [p.grad for p in mine.parameters() if p.grad is not None]
        squared = torch.nn.utils.get_total_norm(grads).pow(2).reshape(1)
        dist.all_reduce(squared)  # the global norm over all stages
        torch.nn.utils.clip_grads_with_norm_(list(mine.parameters()), w.clip, squared.sqrt().reshape(()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(stamp())
    return stamps


HAND_LOOPS = {
    "single": hand_single,
    "ddp": hand_ddp,
    "fsdp": hand_fsdp,
    "zero2": lambda w: hand_deepspeed(w, 2),
    "zero3": lambda w: hand_deepspeed(w, 3),
    "pipeline": hand_pipeline,
}

#: What each hand-written loop calls, for the results table.
HAND_DESCRIPTION = {
    "single": "model(x), loss / accumulate, backward, clip_grad_norm_, AdamW.step",
    "ddp": "DistributedDataParallel, no_sync() off the boundary, clip_grad_norm_",
    "fsdp": (
        "FSDP2 fully_shard per unit (each Linear of the MLP, each block of the LM) + root, "
        "set_requires_gradient_sync, clip_grad_norm_ (DTensor)"
    ),
    "zero2": "deepspeed.initialize(stage 2), engine.backward + engine.step every micro-batch",
    "zero3": "deepspeed.initialize(stage 3), engine.backward + engine.step every micro-batch",
    "pipeline": "torch.distributed.pipelining ScheduleGPipe, 2 stages, clip over all-reduced squared norms",
}
