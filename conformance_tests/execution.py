"""Running one fit for the suite (:func:`execute_run`) and checking precision declarations.

A run whose Trainer refuses the configuration with a ``ConfigurationError``
*before* ``fit`` starts the process group and the strategy's setup
(``trainer.setup_started`` is still ``False``) is recorded as ``refused``,
with the option, the declared feature (:class:`unison.DeclaredRefusal`) and
the message; the comparison decides whether the declaration allowed it. A
``ConfigurationError`` once setup started, and any other exception, is an
``error`` with the traceback: never a refusal. A run that resumes from one
which left no checkpoint is ``not_run`` (it never started; the cell is judged
on the run before it). If a rank fails inside a
collective the other ranks cannot continue: the world then times out and every
strategy run of it is reported with the world's error, which names the run
each rank was in and, for a hang, each rank's stack (dumped by
``faulthandler`` shortly before the world is killed).

The reference strategy (:data:`REFERENCE`, ``single``) runs in the suite's own process;
:func:`check_precision_declarations` builds a Trainer per standard precision without training.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import math
import os
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

import unison
from unison.conformance.data import Sizing
from unison.conformance.feature_probes import FeatureProbe
from unison.conformance.models import OPTIMIZERS, SCHEDULERS, build_model, loss_fn, perturb, training_step
from unison.conformance.profiling import (
    analyse_collectives,
    engine_boundaries,
    flight_entries,
    process_groups,
    profile_collectives,
    records,
    records_groups,
    records_payloads,
)
from unison.conformance.sensitivity import PrecisionProbe, probes_apply
from unison.conformance.spec import Run, Scenario
from unison.conformance.trace import TraceRecorder
from unison.conformance.validation import validation_data
from unison.conformance.workloads import huggingface_slice_mean, token_loss, token_slice_mean
from unison.contract.ownership import STANDARD_PRECISIONS, WorldSizes
from unison.errors import ConfigurationError, DeclaredRefusal

REFERENCE = "single"


#: The scenarios' losses for the ``loss_fn`` form, by :attr:`Scenario.loss <unison.conformance.spec.Scenario.loss>`.
LOSSES: dict[str, Any] = {"mse": loss_fn, "token": token_loss, "token_slice_mean": token_slice_mean}


def loss_form(scenario: Scenario, run: Run) -> dict[str, Any]:
    """The ``fit`` arguments that say how ``run`` computes its loss (none: the Hugging Face path)."""
    if scenario.form == "huggingface":
        # Neither loss_fn nor training_step: the trainer trains the model's own loss, token-weighted (the
        # control run trains each slice's own mean through training_step instead).
        return {"training_step": huggingface_slice_mean} if run.loss == "token_slice_mean" else {}
    if scenario.form == "training_step":
        return {"training_step": training_step}
    return {"loss_fn": LOSSES[run.loss or scenario.loss]}


def make_plugin_manager(plugins: Sequence[str] = ()) -> unison.PluginManager:
    """A manager with the entry-point plugins plus ``plugins`` (module names).

    A module that is already registered (installed *and* named) is not
    registered twice.
    """
    pm = unison.PluginManager()
    for name in plugins:
        module = importlib.import_module(name)
        if not pm.is_registered(module):
            pm.register(module, name=name)
    pm.check_pending()
    return pm


def execute_run(
    scenario: Scenario,
    run: Run,
    *,
    strategy: str,
    sizing: Sizing,
    plugins: Sequence[str],
    checkpoint_dir: Path | None,
    resume_path: Path | None,
    root_dir: Path | None = None,
) -> dict[str, Any]:
    """One ``fit`` of ``scenario`` under ``strategy``; returns its trace (on every rank).

    A run with ``defaults`` keeps the Trainer's default callbacks, loggers (writing under ``root_dir``) and
    progress display; every other run has loggers and progress off.
    """
    started = time.perf_counter()
    dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if dist_on else 0
    trace: dict[str, Any] = {"status": "ok", "rank": rank}
    trainer: Any = None
    try:
        pm = make_plugin_manager(plugins)
        model = build_model(scenario.model)
        recorder = TraceRecorder(buffer_names=[name for name, _ in model.named_buffers()])
        probe = PrecisionProbe() if run.backend == "strategy" and probes_apply(scenario) else None
        if probe is not None:
            probe.attach(model)
        settings = scenario.trainer_settings(sizing, run)
        if checkpoint_dir is not None:
            settings["checkpoint_dir"] = str(checkpoint_dir)
        if run.defaults:
            # The default JSONL and CSV loggers write a run directory: the suite's own, never the caller's.
            settings["root_dir"] = str(root_dir)
        # loggers=False: the suite's runs leave no run directory behind (but a run with the defaults on).
        loggers: dict[str, Any] = {} if run.defaults else {"loggers": False}
        trainer = unison.Trainer(strategy=strategy, plugin_manager=pm, callbacks=[recorder], **loggers, **settings)
        optimizers: list[torch.optim.Optimizer] = recorder.optimizers
        schedulers: list[Any] = []

        def make_optimizer(params: Any) -> torch.optim.Optimizer:
            opt = OPTIMIZERS[scenario.optimizer](params)
            optimizers.append(opt)
            opt.register_step_post_hook(lambda *_: recorder.count_update())
            if probe is not None:
                probe.watch(opt)
            return opt

        def make_scheduler(opt: torch.optim.Optimizer) -> Any:
            sched = SCHEDULERS[scenario.scheduler](opt)  # type: ignore[index]
            schedulers.append(sched)
            return sched

        if run.perturb is not None and rank != 0:
            perturb(model, run.perturb, rank)
        data = scenario.dataset(sizing)
        form = loss_form(scenario, run)
        if scenario.val_every:
            form["val_dataset"] = validation_data()
        feature_probe = FeatureProbe(scenario.probe) if scenario.probe is not None else contextlib.nullcontext()
        with (
            profile_collectives(dist_on, shapes=records_payloads(scenario)) as prof_box,
            pm.record_hook_calls(prefix="unison_") as hooks,
            feature_probe,
            _quiet(run.defaults),
            _eager_random(run),
        ):
            progress = trainer.fit(
                model,
                data,
                **form,
                optimizer=make_optimizer,
                lr_scheduler=make_scheduler if scenario.scheduler else None,
                ckpt_path=resume_path,
            )
        recorder.close_mark()
        recs = records(prof_box[0], flight_entries() if records_groups(scenario) else None) if prof_box else None
        start = recorder.start_counts or {
            "optimizer_steps": progress.optimizer_steps,
            "scheduler_steps": progress.scheduler_steps,
        }
        trace.update(
            steps=recorder.steps,
            hooks=list(hooks),
            counts={
                "optimizer_steps": progress.optimizer_steps,
                "scheduler_steps": progress.scheduler_steps,
                "optimizer_steps_at_start": start["optimizer_steps"],
                "scheduler_steps_at_start": start["scheduler_steps"],
                # Optimizer steps in which the user's optimizer really stepped.
                "optimizer_updates_observed": sum(1 for n in recorder.step_calls.values() if n > 0),
                "optimizer_steps_outside_update": recorder.updates_outside_window,
                "optimizers_built": len(optimizers),
                "scheduler_last_epoch": schedulers[-1].last_epoch if schedulers else None,
            },
            # The engine's is_accumulation_boundary() answers, from the loop's marks (profiled runs only).
            boundaries=engine_boundaries(recs) if recs is not None else None,
            accumulation_owner=trainer.ownership.grad_accumulation.owner.value,
            accumulation_sync=trainer.ownership.grad_accumulation.sync.value,
            precision_owner=trainer.ownership.precision_support(scenario.precision).owner.value,
            mesh=trainer.ownership.mesh is not None,
            param_groups=recorder.param_groups,
            saved_optimizer_state=recorder.saved_optimizer_state,
            loaded_optimizer_state=recorder.loaded_optimizer_state,
            world_size=torch.distributed.get_world_size() if dist_on else 1,
            # Replicas that synchronise gradients (a tensor-parallel or pipeline world has fewer than ranks).
            data_parallel_size=trainer.strategy.data_parallel_size(torch.distributed.get_world_size())
            if dist_on
            else 1,
            collectives=analyse_collectives(recs) if recs is not None else None,
            # Group name -> ranks, at the first step and at the end (a group destroyed at teardown included).
            process_groups={**recorder.process_groups, **process_groups()},
            state=trainer.full_state_dict(),
            buffer_snapshots=recorder.buffer_snapshots,
            validations=recorder.validations,
        )
        if probe is not None:
            trace["precision_probe"] = probe.result()
        if isinstance(feature_probe, FeatureProbe):
            trace["feature_probe"] = feature_probe.result()
    except ConfigurationError as exc:
        if trainer is not None and trainer.setup_started:
            # Bad input is refused before the process group and the strategy's
            # setup; a ConfigurationError after that is a failure, never a refusal.
            trace.update(status="error", error=traceback.format_exc(limit=12))
        else:
            trace.update(
                status="refused",
                reason=str(exc),
                refusal={
                    "type": type(exc).__name__,
                    "option": exc.option,
                    "problem": exc.problem,
                    "feature": exc.feature if isinstance(exc, DeclaredRefusal) else None,
                    "message": str(exc),
                    "in_constructor": trainer is None,
                },
            )
    except BaseException as exc:
        # Every failure of a run is a failed cell, upstream BaseException
        # subclasses included (torch.distributed.checkpoint's
        # CheckpointException derives from BaseException); only the user's
        # own interrupt stops the suite.
        if isinstance(exc, KeyboardInterrupt):
            raise
        trace.update(status="error", error=traceback.format_exc(limit=12))
    trace["wall_s"] = time.perf_counter() - started
    return trace


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """The default progress display of a run with the defaults on is drawn into nothing: the report is the
    suite's output. (It still runs: what it does between the steps is what the run checks.)"""
    if not enabled:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _eager_random(run: Run) -> contextlib.AbstractContextManager[Any]:
    """A compiled run's random ops draw from eager's generator (inductor's ``fallback_random``).

    Inductor otherwise compiles dropout with its own Philox stream (pytorch/pytorch#118735: by design), so
    a compiled run could not be compared with the strategy's uncompiled one on a model with dropout. With
    eager's generator, a compile path that draws from it (a warm-up forward) or reseeds it is seen.
    """
    if not dict(run.overrides).get("compile"):
        return contextlib.nullcontext()
    from unison._upstream.torch import eager_random_ops

    return eager_random_ops()


@contextlib.contextmanager
def _as_rank_zero_of(world_size: int) -> Iterator[None]:
    """Let a Trainer built here see the world size it would be launched at."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def accepted_world_size(world_sizes: WorldSizes, preferred: int) -> int:
    """``preferred`` when the declaration accepts it, else the smallest world size it accepts."""
    if world_sizes.refusal(preferred) is None:
        return preferred
    n = max(world_sizes.minimum, world_sizes.multiple_of)
    while world_sizes.refusal(n) is not None:
        n += 1
    return n


def check_precision_declarations(strategy: str, plugins: Sequence[str], sizing: Sizing) -> list[dict[str, Any]]:
    """Build a Trainer for every standard precision and record what happened.

    Runs in this process: nothing here may start a process group, which is
    itself checked (``process_group_started``). The Trainers see the suite's
    world size, or the smallest one the strategy declares it accepts (a
    2-stage pipeline is checked at 2 when the suite runs at 1): the precision
    declarations hold at every accepted size.
    """
    pm = make_plugin_manager(plugins)
    ownership = pm.strategies.create(strategy).ownership
    world_size = accepted_world_size(ownership.world_sizes, sizing.world_size)
    batch = 4 * math.lcm(world_size, sizing.micro_batch)
    outcomes = []
    for precision in STANDARD_PRECISIONS:
        support = ownership.precision_support(precision)
        before = torch.distributed.is_available() and torch.distributed.is_initialized()
        raised = None
        try:
            with _as_rank_zero_of(world_size):
                unison.Trainer(
                    strategy=strategy,
                    plugin_manager=make_plugin_manager(plugins),
                    precision=precision,
                    global_batch_size=batch,
                    max_steps=1,
                    accelerator="cpu",
                    progress="off",
                )
        except BaseException as exc:  # recorded, judged by compare
            if isinstance(exc, KeyboardInterrupt):
                raise
            raised = {
                "type": type(exc).__name__,
                "is_configuration_error": isinstance(exc, ConfigurationError),
                "option": getattr(exc, "option", None),
                "feature": getattr(exc, "feature", None),
                "message": str(exc),
            }
        after = torch.distributed.is_available() and torch.distributed.is_initialized()
        outcomes.append(
            {
                "precision": precision,
                "declared": "supported" if support.supported else "unsupported",
                "owner": support.owner.value,
                "detail": support.detail,
                "raised": raised,
                "world_size": world_size,
                "process_group_started": after and not before,
            }
        )
    return outcomes
