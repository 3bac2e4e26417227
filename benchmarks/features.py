"""What ``compile`` and ``activation_checkpointing`` cost and buy here, and the MFU Throughput logs.

``python -m benchmarks.features`` trains the tinylm transformer (examples/tinylm.py: d_model 128, 4
blocks, sequence 128, batch 16) with ``strategy="single"`` on the CPU, and prints one markdown table:

* **compile**: the first step's wall time with and without ``compile=True`` (inductor; the difference
  is the compilation, with inductor's on-disk cache as it is), and the steady-state step time (median
  of the steps after the first ``WARMUP``) with and without;
* **activation checkpointing**: the bytes autograd keeps from one forward for its backward
  (``torch.autograd.graph.saved_tensors_hooks`` around a training forward, the memory checkpointing
  frees) and the peak RSS of a fresh process that trains 3 steps of ``MEMORY_BATCH`` samples, with and
  without ``activation_checkpointing="full"``, and the steady-state step time;
* **MFU**: ``perf/mfu`` and ``perf/flops_per_step`` as the default Throughput logs them.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import unison

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
WARMUP = 3
MODEL = {"d_model": 128, "n_heads": 4, "n_layers": 4, "seq_len": 128}
BATCH = 16


def _model() -> torch.nn.Module:
    sys.path.insert(0, str(ROOT / "examples"))
    from tinylm import TinyLM

    torch.manual_seed(0)
    return TinyLM(**MODEL)


def _data(batch: int = BATCH) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch * (STEPS + 1), MODEL["seq_len"] + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _StepTimes:
    """Wall time of every optimizer step (a plugin)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    @unison.hookimpl
    def unison_on_train_step_start(self, trainer: Any) -> None:
        self._start = time.perf_counter()

    @unison.hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int, output: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def train(batch: int = BATCH, steps: int = STEPS, **options: Any) -> dict[str, Any]:
    """One fit of ``steps`` steps of ``batch`` samples; its step times and the last Throughput metrics."""
    times = _StepTimes()
    trainer = unison.Trainer(
        max_steps=steps,
        global_batch_size=batch,
        accelerator="cpu",
        progress="off",
        loggers=False,
        callbacks=[times],
        **options,
    )
    trainer.fit(_model, _data(batch), loss_fn=_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    metrics = trainer.progress.metrics
    return {
        "first_s": times.times[0],
        "steady_s": statistics.median(times.times[WARMUP:] or times.times),
        "mfu": metrics.get("perf/mfu"),
        "flops_per_step": metrics.get("perf/flops_per_step"),
    }


def saved_bytes(policy: str | None) -> int:
    """Bytes autograd keeps from one training forward of the model, checkpointed by ``policy`` or not."""
    from unison.contract.transforms import checkpoint_blocks

    model = _model()
    if policy is not None:
        checkpoint_blocks(model, policy)
    x, y = _data()[:BATCH]
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model(x), y)
    loss.backward()
    return total


#: Samples per step of the peak-RSS runs: enough that activations, not the interpreter, set the peak.
MEMORY_BATCH = 64


def peak_rss_mib(policy: str | None) -> float:
    """Peak RSS of a fresh process that trains 3 steps of ``MEMORY_BATCH`` (checkpointed by ``policy`` or not)."""
    code = (
        "import json, sys; sys.path.insert(0, '.'); from benchmarks.features import MEMORY_BATCH, train; "
        "from unison.plugins.callbacks import peak_rss_mib; "
        f"train(MEMORY_BATCH, 3, activation_checkpointing={policy!r}); print(json.dumps(peak_rss_mib()))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    plain = train()
    compiled = train(compile=True)
    checkpointed = train(activation_checkpointing="full")
    rows = [
        ("step time, steady state (ms)", plain["steady_s"] * 1e3, compiled["steady_s"] * 1e3),
        ("first step (ms; with compile: the compilation)", plain["first_s"] * 1e3, compiled["first_s"] * 1e3),
    ]
    print(f"tinylm {MODEL}, batch {BATCH}, {STEPS} steps, single, CPU, torch {torch.__version__}\n")
    print("| compile | without | compile=True | ratio |\n|---|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    saved = (saved_bytes(None), saved_bytes("full"))
    rss = (peak_rss_mib(None), peak_rss_mib("full"))
    print('\n| activation checkpointing | without | "full" | ratio |\n|---|---|---|---|')
    print(
        f"| saved for backward per forward (MiB) | {saved[0] / 2**20:.1f} | {saved[1] / 2**20:.1f} | "
        f"{saved[1] / saved[0]:.2f} |"
    )
    print(f"| peak RSS, batch {MEMORY_BATCH} (MiB) | {rss[0]:.0f} | {rss[1]:.0f} | {rss[1] / rss[0]:.2f} |")
    print(
        f"| step time, steady state (ms) | {plain['steady_s'] * 1e3:.1f} | {checkpointed['steady_s'] * 1e3:.1f} | "
        f"{checkpointed['steady_s'] / plain['steady_s']:.2f} |"
    )
    mfu = {"plain": plain["mfu"], "compile": compiled["mfu"], "activation_checkpointing": checkpointed["mfu"]}
    flops = {"plain": plain["flops_per_step"], "activation_checkpointing": checkpointed["flops_per_step"]}
    print("\n" + json.dumps({"mfu": mfu, "flops_per_step": flops}))


if __name__ == "__main__":
    main()
