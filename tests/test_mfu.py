"""Throughput's FLOPs per step and MFU (one process): the count, the peak, the ratio."""

from __future__ import annotations

import pytest
import torch

import unison
from unison._upstream.torch import flop_counter
from unison.plugins.callbacks import Throughput
from unison.plugins.callbacks.mfu import PEAK_TFLOPS, known_peak_flops, measured_peak_flops

import helpers
from helpers import mlp, regression_data

pytestmark = pytest.mark.timeout(120)


def fit(throughput: Throughput) -> unison.Trainer:
    trainer = unison.Trainer(
        max_steps=4,
        global_batch_size=32,
        accumulate_grad_batches=2,
        accelerator="cpu",
        progress="off",
        loggers=False,
        callbacks=[throughput],
    )
    helpers.fit(trainer, model=mlp, data=regression_data())
    return trainer


def test_flops_per_step_are_what_flop_counter_counts_for_the_linear_layers():
    throughput = Throughput()
    trainer = fit(throughput)
    model = mlp()
    weights = [m.weight.numel() for m in model if isinstance(m, torch.nn.Linear)]
    samples = 32  # one optimizer step: 2 micro-batches of 16
    # forward 2*N per sample, weight gradients 2*N, input gradients 2*N for every layer but the first
    # (the inputs need no gradient): 6*N*samples less the first layer's input gradient.
    assert throughput.flops_per_step == 6 * sum(weights) * samples - 2 * weights[0] * samples
    assert trainer.progress.metrics["perf/flops_per_step"] == throughput.flops_per_step
    assert 0 < trainer.progress.metrics["perf/mfu"] <= 1


def test_mfu_against_a_peak_the_user_sets():
    trainer = fit(Throughput(peak_flops=1e6))  # a slow device: MFU well above the CPU's
    metrics = trainer.progress.metrics
    assert metrics["perf/mfu"] == pytest.approx(metrics["perf/flops_per_step"] / metrics["perf/step_time"] / 1e6)


def test_known_peaks_and_the_measured_cpu_peak():
    assert known_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert known_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert known_peak_flops("NVIDIA H200", torch.float32) == 67e12
    assert known_peak_flops("NVIDIA L4", torch.float16) == 121e12
    assert known_peak_flops("Quadro P1000", torch.float32) is None
    assert len({key for key, _, _ in PEAK_TFLOPS}) == len(PEAK_TFLOPS)
    peak = measured_peak_flops(torch.float32)
    assert peak > 1e8 and measured_peak_flops(torch.float32) == peak  # measured once per process


def test_the_cpu_peak_is_measured_outside_any_flop_counter():
    from unison.plugins.callbacks import mfu

    mfu._MEASURED.clear()
    with flop_counter() as counted:
        assert measured_peak_flops(torch.float32) > 0
    assert counted.total == 0
