"""Model FLOPs utilisation: FLOPs per step counted once, and the device's peak to divide by.

MFU = FLOPs of one optimizer step / its wall time / the device's peak FLOP/s.

* **FLOPs per step** are counted by :func:`unison._upstream.torch.flop_counter` (the formulas of
  :mod:`torch.utils.flop_counter`) over one whole optimizer step (every micro-batch's forward and backward on
  this rank), once per fit: every step has the same shapes, so one count
  serves them all. It counts what executes: with activation checkpointing
  the recomputed forwards count too (hardware FLOPs, above the model's).
* **The peak** is what the user gives (``Throughput(peak_flops=...)``), else
  :data:`PEAK_TFLOPS` for a known CUDA device, else, on CPU, a matrix
  product measured once per process (:func:`measured_peak_flops`).
"""

from __future__ import annotations

import time

import torch

from unison._upstream.torch import outside_dispatch_modes

#: Dense (no sparsity) peak TFLOP/s per device, by a substring of ``torch.cuda.get_device_name()``:
#: ``(bf16/fp16 tensor core, fp32)``. From NVIDIA's datasheets, whose tensor-core figures are quoted
#: "with sparsity" (twice the dense rate, halved here): A100 SXM/PCIe (312 bf16, 19.5 fp32), H100 SXM
#: (1,979 sparse -> 989 bf16, 67 fp32), H100 PCIe (1,513 sparse -> 756 bf16, 51 fp32), H200 SXM (1,979
#: sparse -> 989 bf16, 67 fp32), L4 (242 sparse -> 121 bf16, 30.3 fp32), L40S (733 sparse -> 362 bf16,
#: 91.6 fp32). fp32 is the CUDA-core rate: torch's default float32 matmul precision ("highest") does not
#: use TF32. Checked in order, so "H100 PCIe" is matched before "H100".
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.0, 67.0),
    ("A100", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L4", 121.0, 30.3),
)

_MEASURED: dict[tuple[str, torch.dtype], float] = {}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matrix products run in under ``precision`` (``bf16-*``: bf16; ``16-mixed``: fp16; else fp32)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


def known_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """:data:`PEAK_TFLOPS` for ``device_name`` in FLOP/s, or ``None`` for a device not in the table."""
    for key, half, single in PEAK_TFLOPS:
        if key in device_name:
            return (single if dtype == torch.float32 else half) * 1e12
    return None


def measured_peak_flops(dtype: torch.dtype = torch.float32, n: int = 512, budget_s: float = 0.1) -> float:
    """FLOP/s of the fastest ``n x n`` CPU matrix product in ``dtype``; measured once per process.

    Trials run until ``budget_s`` is spent (at least two, at most ten), so the cost is bounded whatever
    the dtype: a CPU without native fp16 arithmetic takes about 0.1 s per 512 x 512 fp16 product (2 s at
    1024), while fp32 and bf16 take milliseconds and reach this machine's rate at 512 already.
    The fastest, not the mean: on a shared machine a trial the scheduler interrupts runs slow, and the
    peak is what the hardware reaches when it is not. This process's own thread settings
    (``OMP_NUM_THREADS``) apply, the right yardstick for a step that runs under the same settings.
    """
    key = ("cpu", dtype)
    if key not in _MEASURED:
        # Outside any dispatch mode: a FLOP counter active around the step (the conformance suite's, a
        # user's) must neither count the measurement nor slow it down.
        # Its own generator: a plugin never draws from the global one, whose state is training's (dropout
        # masks, shuffles), so the defaults on or off and a resume in a new process train alike.
        generator = torch.Generator().manual_seed(0)
        with outside_dispatch_modes():
            a = torch.randn(n, n, generator=generator).to(dtype)
            b = torch.randn(n, n, generator=generator).to(dtype)
            torch.mm(a, b)  # warm up
            fastest, spent, trials = float("inf"), 0.0, 0
            while trials < 2 or (trials < 10 and spent < budget_s):
                start = time.perf_counter()
                torch.mm(a, b)
                elapsed = time.perf_counter() - start
                fastest, spent, trials = min(fastest, elapsed), spent + elapsed, trials + 1
        _MEASURED[key] = 2 * n**3 / fastest
    return _MEASURED[key]


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The peak FLOP/s of ``device`` for ``precision``: the table for CUDA, a measured matrix product on CPU."""
    dtype = compute_dtype(precision)
    if device.type == "cuda":
        return known_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return measured_peak_flops(dtype)
    return None
