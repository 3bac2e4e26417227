"""``python -m benchmarks.cuda``: ddp and fsdp in bf16 on one CUDA device, unison against hand-written loops.

The realistic workload (:class:`~benchmarks.workload.LMWorkload`) widened to a
GPU's scale, trained in a one-rank NCCL world by unison (``precision=
"bf16-mixed"``: autocast under ddp, FSDP2's ``MixedPrecisionPolicy`` under
fsdp) and by a hand-written loop on the same backend API with the same
precision. Both feed pinned batches and copy them without blocking.

In both, every step between the warm-up and the last runs under
``torch.cuda.set_sync_debug_mode("error")``: any call that synchronises the
host with the device raises there, so a run that finishes made none (nothing
is logged inside that window). Reported: tokens/s and the unison / hand
ratio per round, alternated. Prints one JSON line per result and writes them
to ``--output``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from benchmarks.workload import LMWorkload


class Window:
    """The timed, sync-free window: steps ``warmup`` .. ``steps - 1``, synchronised only at its two ends."""

    def __init__(self, w: LMWorkload) -> None:
        self.w, self.start, self.end = w, 0.0, 0.0

    def step_start(self, step: int) -> None:
        if step == self.w.warmup:
            torch.cuda.synchronize()
            self.start = time.perf_counter()
            torch.cuda.set_sync_debug_mode("error")

    def step_end(self, step: int) -> None:
        if step == self.w.steps - 1:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            self.end = time.perf_counter()

    def tokens_per_s(self) -> float:
        timed = self.w.steps - self.w.warmup
        return timed * self.w.global_batch * self.w.seq_len / (self.end - self.start)


def _loader(w: LMWorkload) -> DataLoader:
    sampler = [idx for step in range(w.steps) for idx in w.micro_indices(step, 1, 0)]
    return DataLoader(w.data(), batch_sampler=sampler, pin_memory=True)


def hand(w: LMWorkload, strategy: str) -> float:
    """The hand-written loop: DDP + autocast, or FSDP2 per block with a bf16 policy; returns tokens/s."""
    device = torch.device("cuda", 0)
    model = w.model().to(device)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[0])
        autocast: Any = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cuda", (1,))
        inner = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
        for block in model:
            if type(block).__name__ in w.shard_classes:
                fully_shard(block, mesh=mesh, mp_policy=inner)
        fully_shard(model, mesh=mesh, mp_policy=root)
        autocast = contextlib.nullcontext
    opt = w.optimizer(model.parameters())
    window = Window(w)
    batches = iter(_loader(w))
    for step in range(w.steps):
        window.step_start(step)
        for m in range(w.accumulate):
            x, y = (t.to(device, non_blocking=True) for t in next(batches))
            last = m == w.accumulate - 1
            if strategy == "ddp":
                sync = model.no_sync() if not last else contextlib.nullcontext()
            else:
                model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            with sync:
                with autocast():
                    loss = w.loss(model(x), y)
                (loss / w.accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.step_end(step)
    return window.tokens_per_s()


def with_unison(w: LMWorkload, strategy: str) -> float:
    """The same training through ``unison.Trainer``; returns tokens/s."""
    import unison

    window = Window(w)

    class Timed:
        @unison.hookimpl
        def unison_on_train_step_start(self, step: int) -> None:
            window.step_start(step)

        @unison.hookimpl
        def unison_on_train_step_end(self, step: int) -> None:
            window.step_end(step)

    trainer = unison.Trainer(
        strategy=strategy,
        accelerator="cuda",
        precision="bf16-mixed",
        callbacks=[Timed()],
        loggers=False,
        throughput=False,
        pin_memory=True,
        **w.unison_settings(**({"strategy_options": o} if (o := w.strategy_options(strategy)) else {})),
    )
    trainer.fit(w.model, w.data(), loss_fn=w.loss, optimizer=w.optimizer)
    return window.tokens_per_s()


def mfu(w: LMWorkload, strategy: str) -> dict[str, Any]:
    """``Throughput``'s FLOPs per step and MFU on this device, beside the analytic ``6 * N * tokens``."""
    import unison

    trainer = unison.Trainer(
        strategy=strategy,
        accelerator="cuda",
        precision="bf16-mixed",
        loggers=False,
        pin_memory=True,
        **w.unison_settings(
            log_every_n_steps=w.steps,
            **({"strategy_options": o} if (o := w.strategy_options(strategy)) else {}),
        ),
    )
    trainer.fit(w.model, w.data(), loss_fn=w.loss, optimizer=w.optimizer)
    metrics = trainer.progress.metrics
    n = w.parameters()
    tokens = w.global_batch * w.seq_len
    return {
        "strategy": strategy,
        "flops_per_step": metrics.get("perf/flops_per_step"),
        "analytic_6_n_tokens": 6 * n * tokens,
        "mfu": metrics.get("perf/mfu"),
        "step_time_s": metrics.get("perf/step_time"),
    }


def features(w: LMWorkload) -> list[dict[str, Any]]:
    """``single`` in bf16 without and with ``activation_checkpointing="full"`` and ``compile=True``.

    Per configuration: the first step's time (with ``compile``, the compilation), the steady step time
    (synchronised at the window's ends) and ``torch.cuda.max_memory_allocated`` over the fit.
    """
    import unison

    out = []
    for options in ({}, {"activation_checkpointing": "full"}, {"compile": True}):

        class Marks:
            def __init__(self) -> None:
                self.at: dict[str, float] = {}

            @unison.hookimpl
            def unison_on_train_step_start(self, step: int) -> None:
                if step in (0, w.warmup):
                    torch.cuda.synchronize()
                    self.at[f"start{step}"] = time.perf_counter()

            @unison.hookimpl
            def unison_on_train_step_end(self, step: int) -> None:
                if step in (0, w.steps - 1):
                    torch.cuda.synchronize()
                    self.at[f"end{step}"] = time.perf_counter()

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        trainer = unison.Trainer(
            strategy="single",
            accelerator="cuda",
            precision="bf16-mixed",
            callbacks=[marker := Marks()],
            loggers=False,
            throughput=False,
            pin_memory=True,
            **w.unison_settings(**options),
        )
        trainer.fit(w.model, w.data(), loss_fn=w.loss, optimizer=w.optimizer)
        marks = marker.at
        out.append(
            {
                "options": options,
                "first_step_s": marks["end0"] - marks["start0"],
                "steady_step_s": (marks[f"end{w.steps - 1}"] - marks[f"start{w.warmup}"]) / (w.steps - w.warmup),
                "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
        )
    return out


def rounds(w: LMWorkload, strategy: str, n: int) -> dict[str, Any]:
    """``n`` alternated rounds in this (one-rank NCCL) world."""
    assert dist.is_initialized()
    out: dict[str, list[float]] = {"hand": [], "unison": []}
    for r in range(n):
        for who in ("hand", "unison") if r % 2 == 0 else ("unison", "hand"):
            torch.cuda.empty_cache()
            out[who].append(hand(w, strategy) if who == "hand" else with_unison(w, strategy))
    per_round = [h / u for h, u in zip(out["hand"], out["unison"])]  # time ratio = inverse throughput ratio
    return {
        "strategy": strategy,
        "precision": "bf16-mixed",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "workload": w.describe(),
        "hand_tokens_per_s": statistics.median(out["hand"]),
        "unison_tokens_per_s": statistics.median(out["unison"]),
        "ratio": statistics.median(out["hand"]) / statistics.median(out["unison"]),
        "per_round_ratios": per_round,
        "host_syncs_in_window": 0,  # a synchronising call inside the window raises (sync debug mode "error")
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cuda", description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--output", default=None, help="a JSON-lines file for the results")
    parser.add_argument("--mfu", action="store_true", help="also log Throughput's FLOPs per step and MFU")
    parser.add_argument(
        "--features",
        action="store_true",
        help="single: peak memory and step time with activation checkpointing and with compile",
    )
    args = parser.parse_args()
    from unison.launch.torchrun import spawn

    w = LMWorkload(
        d_model=args.d_model,
        heads=16,
        blocks=args.blocks,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        samples=args.global_batch * args.steps,
        steps=args.steps,
        warmup=args.warmup,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    if args.features:
        for result in features(w):
            line = json.dumps(result)
            print(line, flush=True)
            if args.output:
                with open(args.output, "a") as f:
                    f.write(line + "\n")
    for strategy in args.strategies.split(","):
        results = []
        if args.rounds:
            results.append(spawn(rounds, 1, w, strategy, args.rounds, timeout=540, backend="nccl")[0])
        if args.mfu:
            results.append(spawn(mfu, 1, w, strategy, timeout=540, backend="nccl")[0])
        for result in results:
            line = json.dumps(result)
            print(line, flush=True)
            if args.output:
                with open(args.output, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
