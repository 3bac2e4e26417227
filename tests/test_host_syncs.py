"""Host synchronisations per optimizer step: none on a step that logs nothing, beyond the documented ones.

Every call that moves a tensor's value to the host (``item``, ``tolist``,
``float()``, ``int()``, ``bool()``, ``cpu``, ``numpy``) is a device-to-host
synchronisation when the tensor lives on an accelerator. The counter below
patches those methods on ``torch.Tensor`` and attributes each call to the code
that made it: a read by unison's own code (``core/``, ``strategies/``,
``plugins/``) is the framework's. Reads inside torch or a backend library (the
optimizer's step counters, the pipeline schedule's metadata, DeepSpeed's
engine) are theirs: a hand-written loop calling the same APIs makes them too.

Documented numbers per non-logging optimizer step (README, "Performance"):

* fp32 or bf16 with ``nonfinite="continue"`` or ``"raise"`` (the default): 0 device reads. ``raise``
  reads the previous step's finiteness flag from a host copy made without blocking, once the current
  step's work is queued (``nonfinite.py:resolve``; on CUDA it waits on that step's event, never on the
  stream): a host-only read;
* ``nonfinite="skip"``: 1 (whether to skip must be known before the update);
* ``16-mixed``: 1 (the loss scaler's skip decision), whatever ``nonfinite`` is.

Host-only reads are not device synchronisations on any machine and are listed
by call site with the reason: the sampler's index lists (a CPU ``randperm``),
the lagged finiteness flag, a pipeline schedule's mean-loss marker (read by
the loop only when it is a CPU tensor: it then skips a multiplication of every
gradient by 1) and, in a distributed run, the stop-flag agreement (a CPU
tensor all-reduced over the gloo control group, or carried in the loss
all-reduce when that runs on the CPU, started at one step boundary and read
at the next). The test fails on any other site.

This machine has no GPU, so every tensor is on the CPU; the sites are told
apart by where the read happens, which is what would synchronise on a GPU.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

import unison
from unison.launch.torchrun import spawn

from helpers import mlp, regression_data

#: Methods whose call reads a tensor's value on the host.
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")

_TORCH = str(Path(torch.__file__).parent)
_UNISON = tuple(
    str(Path(m.__file__).parent)
    for m in (unison, __import__("unison.strategies").strategies, __import__("unison.plugins").plugins)
)

#: Reads of tensors that live on the host by construction (never a device sync), by ``file:function``.
HOST_ONLY = {
    "plan.py:global_indices": "the sampler's index list, sliced from a CPU torch.randperm",
    "batch.py:count_tokens": "tokens of a collated batch, counted on the host before it moves to the device",
    "stopping.py:_read": "should_stop / stop-request flags: a CPU tensor all-reduced on the gloo control group",
    "nonfinite.py:resolve": "the previous step's finiteness flag, from its host copy (CUDA: after that step's event)",
    "loop.py:_normalise": "a schedule's mean-loss marker, read only when the loss is on the CPU (else on the device)",
}

#: Documented device reads per non-logging step, by (precision, nonfinite).
DOCUMENTED = {
    ("32-true", "continue"): 0,
    ("bf16-mixed", "continue"): 0,
    ("32-true", "raise"): 0,
    ("bf16-mixed", "raise"): 0,
    ("32-true", "skip"): 1,
    ("16-mixed", "continue"): 1,
    ("16-mixed", "raise"): 1,
}


class SyncCounter:
    """Counts host reads by unison's code, per optimizer step and call site (a real plugin for the step number)."""

    def __init__(self) -> None:
        self.step = -1
        self.by_step: dict[int, Counter] = defaultdict(Counter)
        #: Reads per step made by code outside unison and torch (user callbacks).
        self.outside: Counter = Counter()
        self._saved: dict[str, Any] = {}

    @unison.hookimpl
    def unison_on_train_step_start(self, step: int) -> None:
        # A step's window runs to the next step's start: its logging and stop agreement are in it.
        self.step = step

    @unison.hookimpl
    def unison_on_fit_end(self) -> None:
        self.step = -1

    def _site(self) -> str | None:
        """``file:function`` of the code that called the read when it is unison's; ``""`` for this test's code.

        Reads made by torch itself (the optimizer's step counters, the pipeline
        schedule's metadata) or by a backend library are theirs: a hand-written
        loop calling the same APIs makes the same reads. ``None`` for those.
        """
        filename = sys._getframe(2).f_code.co_filename
        if filename == __file__:
            return ""
        if not filename.startswith(_UNISON):
            return None
        frame = sys._getframe(2)
        return f"{Path(filename).name}:{frame.f_code.co_name}"

    def __enter__(self) -> SyncCounter:
        counter = self

        def wrap(name: str, original: Any) -> Any:
            def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if counter.step >= 0:
                    site = counter._site()
                    if site:
                        counter.by_step[counter.step][f"{site}:{name}"] += 1
                    elif site == "":
                        counter.outside[counter.step] += 1
                return original(self, *args, **kwargs)

            return read

        for name in READS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def device_reads(self, step: int) -> Counter:
        """The step's reads outside the host-only sites."""
        return Counter({k: v for k, v in self.by_step[step].items() if k.rsplit(":", 1)[0] not in HOST_ONLY})


class AsksForTensors:
    """A callback that keeps the device values a hook hands it, reading none of them."""

    def __init__(self) -> None:
        self.norms: list[Any] = []
        self.losses: list[Any] = []

    @unison.hookimpl
    def unison_on_before_optimizer_step(self, grad_norm: Any) -> None:
        self.norms.append(grad_norm)

    @unison.hookimpl
    def unison_on_train_step_end(self, output: Any) -> None:
        self.losses.append(output.loss_tensor)


def count_run(
    strategy: str,
    precision: str,
    nonfinite: str,
    *,
    log_every: int = 5,
    steps: int = 10,
    progress: str = "off",
    loggers: tuple = (),
    **settings: Any,
) -> dict[str, Any]:
    """Train with the counter installed; return reads per step and what the callback received."""
    counter, asks = SyncCounter(), AsksForTensors()
    trainer = unison.Trainer(
        strategy=strategy,
        precision=precision,
        nonfinite=nonfinite,
        callbacks=[counter, asks],
        loggers=list(loggers),
        max_steps=steps,
        global_batch_size=16,
        accumulate_grad_batches=2,
        grad_clip_norm=0.5,
        log_every_n_steps=log_every,
        progress=progress,
        **settings,
    )
    with counter:
        trainer.fit(
            mlp(),
            regression_data(n=512),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        )
    return {
        "device": {s: dict(counter.device_reads(s)) for s in range(steps)},
        "all": {s: dict(counter.by_step[s]) for s in range(steps)},
        "tensor_norms": all(isinstance(n, torch.Tensor) for n in asks.norms) and len(asks.norms) == steps,
    }


def _check(run: dict[str, Any], documented: int, reading: Any) -> None:
    """Steps for which ``reading(step)`` is false read exactly ``documented`` values; reading steps read more."""
    steps = len(run["device"])
    for step, reads in run["device"].items():
        if reading(step):
            # A logging (or progress) step reads the metrics: the counter sees the framework's reads.
            assert sum(reads.values()) > documented, (step, reads)
        else:
            assert sum(reads.values()) == documented, (step, reads)
    assert run["tensor_norms"], "before_optimizer_step must hand hooks the grad norm as a device tensor"
    assert sum(not reading(s) for s in range(steps)) >= 2


def logs_every(n: int) -> Any:
    return lambda step: (step + 1) % n == 0


@pytest.mark.parametrize(("precision", "nonfinite"), sorted(DOCUMENTED))
def test_single_reads_only_the_documented_values_on_non_logging_steps(precision, nonfinite):
    run = count_run("single", precision, nonfinite)
    _check(run, DOCUMENTED[(precision, nonfinite)], logs_every(5))
    if DOCUMENTED[(precision, nonfinite)]:
        # The one read is the skip decision in the trainer's step, nowhere else.
        sites = {k for reads in run["device"].values() for k in reads if ":train_step:" in k}
        assert sites == {"loop.py:train_step:__bool__"}, sites
    if nonfinite == "raise" and precision != "16-mixed":
        # Every step's flag is read once, late, from its host copy (the next step, a logging step or the end).
        assert sum(reads.get("nonfinite.py:resolve:__bool__", 0) for reads in run["all"].values()) == 10


def test_progress_throughput_and_loggers_read_nothing_between_their_steps(tmp_path):
    from unison.plugins.loggers import CSVLogger, JSONLLogger

    # Logs after steps 5 and 10, progress lines after every second step: steps 0, 2, 6 and 8 read nothing.
    run = count_run(
        "single",
        "32-true",
        "continue",
        log_every=5,
        progress="plain",
        progress_every_n_steps=2,
        loggers=(JSONLLogger(tmp_path / "j"), CSVLogger(tmp_path / "c")),
    )
    _check(run, 0, lambda step: (step + 1) % 5 == 0 or (step + 1) % 2 == 0)
    # A progress-only step reads the loss it prints (through StepOutput), nothing else.
    assert run["device"][1] == {"outputs.py:micro_losses:tolist": 1}, run["device"][1]


def test_the_counter_attributes_a_callback_read_to_the_callback():
    """A read in user code is seen by the patch but is not unison's: the step still counts 0 for unison."""

    class Reads:
        @unison.hookimpl
        def unison_on_before_optimizer_step(self, grad_norm: Any) -> None:
            float(grad_norm)

    counter = SyncCounter()
    trainer = unison.Trainer(
        strategy="single",
        nonfinite="continue",
        callbacks=[counter, Reads()],
        max_steps=3,
        global_batch_size=16,
        log_every_n_steps=100,
        progress="off",
    )
    with counter:
        trainer.fit(
            mlp(),
            regression_data(),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        )
    # (The last step's window also holds the end of fit, which copies the final state to the host.)
    assert [sum(counter.device_reads(s).values()) for s in range(2)] == [0, 0]
    assert [counter.outside[s] for s in range(3)] == [1, 1, 1]


# --------------------------------------------------------------------------- #
# Distributed: the same counts on every rank of a 2-rank gloo world
# --------------------------------------------------------------------------- #

DISTRIBUTED = ("ddp", "fsdp", "fsdp1", "zero2", "pipeline")


def world_counts() -> dict[str, Any]:
    out = {}
    for strategy in DISTRIBUTED:
        for nonfinite in ("continue", "raise"):
            out[(strategy, nonfinite)] = count_run(strategy, "32-true", nonfinite, steps=6, log_every=3)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return spawn(world_counts, 2, timeout=400)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", DISTRIBUTED)
def test_distributed_steps_read_only_the_documented_values(world, strategy):
    for rank in world:
        for nonfinite in ("continue", "raise"):
            run = rank[(strategy, nonfinite)]
            _check(run, 0, logs_every(3))
            # The stop agreement is a host-only read, never a device read: the flags all-reduced after step
            # k are read at the boundary of step k+1 (and the last step's after the loop).
            for step, reads in run["all"].items():
                assert any(k.startswith("stopping.py:_read") for k in reads) == (step > 0), (step, reads)


# --------------------------------------------------------------------------- #
# CUDA: what the counter above infers on the CPU, asserted by torch on a GPU
# --------------------------------------------------------------------------- #


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cuda_steps_that_log_nothing_make_no_synchronising_call(precision):
    """torch's sync debug mode raises on any synchronising CUDA call inside a step that logs nothing.

    Pinned batches (``pin_memory=True``): a copy from pageable host memory
    synchronises the stream, which is the data's cost, not the step's.
    """

    class Strict:
        @unison.hookimpl
        def unison_on_train_step_start(self, step: int) -> None:
            # A step's window runs to the next step's start; steps 4 and 9 log (and read) at their end, and
            # step 0 sets up the optimizer state and the flag's pinned buffer.
            torch.cuda.set_sync_debug_mode("error" if step > 0 and (step + 1) % 5 else "default")

        @unison.hookimpl
        def unison_on_fit_end(self) -> None:
            torch.cuda.set_sync_debug_mode("default")

    trainer = unison.Trainer(
        strategy="single",
        accelerator="cuda",
        precision=precision,
        callbacks=[Strict()],
        loggers=False,
        throughput=False,
        progress="off",
        pin_memory=True,
        max_steps=10,
        global_batch_size=16,
        accumulate_grad_batches=2,
        grad_clip_norm=0.5,
        log_every_n_steps=5,
    )
    try:
        trainer.fit(
            mlp(),
            regression_data(n=512),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.progress.global_step == 10
