"""Models, data and run functions shared by the tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

import unison


def regression_data(n: int = 512, d: int = 8, seed: int = 123) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = x @ torch.randn(d, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def overflow_data() -> TensorDataset:
    """:func:`regression_data` where one sample's inputs overflow fp16 inside the model (a skipped step)."""
    x, y = regression_data().tensors
    x = x.clone()
    x[3] = 7e4  # beyond fp16's max (65504) after the first Linear
    return TensorDataset(x, y)


def mlp(d: int = 8, hidden: int = 32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(d, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    )


class HookRecorder:
    """Records every lifecycle hook with its step (a real plugin, registered via the manager)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.validation: list[float] = []

    @unison.hookimpl
    def unison_on_fit_start(self, trainer):
        self.calls.append(("fit_start", None))

    @unison.hookimpl
    def unison_on_train_epoch_start(self, epoch):
        self.calls.append(("epoch_start", epoch))

    @unison.hookimpl
    def unison_on_train_epoch_end(self, epoch):
        self.calls.append(("epoch_end", epoch))

    @unison.hookimpl
    def unison_on_train_step_start(self, step):
        self.calls.append(("step_start", step))

    @unison.hookimpl
    def unison_on_after_backward(self, step):
        self.calls.append(("after_backward", step))

    @unison.hookimpl
    def unison_on_before_optimizer_step(self, step, grad_norm):
        self.calls.append(("before_optimizer_step", step))

    @unison.hookimpl
    def unison_on_after_optimizer_step(self, step, skipped):
        self.calls.append(("after_optimizer_step", (step, skipped)))

    @unison.hookimpl
    def unison_on_train_step_end(self, step):
        self.calls.append(("step_end", step))

    @unison.hookimpl
    def unison_on_validation_end(self, step, metrics):
        self.calls.append(("validation_end", step))
        self.validation.append(metrics["val/loss"])

    @unison.hookimpl
    def unison_on_save_checkpoint(self, checkpoint):
        checkpoint["recorder"] = len(self.calls)
        self.calls.append(("save_checkpoint", None))

    @unison.hookimpl
    def unison_on_load_checkpoint(self, checkpoint):
        self.calls.append(("load_checkpoint", checkpoint.get("recorder")))

    @unison.hookimpl
    def unison_on_fit_end(self):
        self.calls.append(("fit_end", None))


def train(
    strategy: str = "single",
    *,
    data: Any = None,
    model: Any = None,
    lr: float = 1e-2,
    scheduler: bool = True,
    record: bool = True,
    ckpt_path: Any = None,
    val: Any = None,
    callbacks: tuple[Any, ...] = (),
    **settings: Any,
) -> dict[str, Any]:
    """Train and return what the parity tests compare (on every rank)."""
    settings = {
        "accumulate_grad_batches": 4,
        "global_batch_size": 32,
        "max_steps": 20,
        "grad_clip_norm": 0.5,
        **settings,
    }
    recorder = HookRecorder()
    trainer = unison.Trainer(strategy=strategy, callbacks=[*([recorder] if record else []), *callbacks], **settings)
    with trainer.pm.record_hook_calls() as monitored:
        progress = trainer.fit(
            model if model is not None else mlp(),
            data if data is not None else regression_data(),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
            lr_scheduler=(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5)) if scheduler else None,
            val_dataset=val,
            ckpt_path=ckpt_path,
        )
    return {
        "state": trainer.full_state_dict(),
        "history": [h.as_dict() for h in progress.history],
        "optimizer_steps": progress.optimizer_steps,
        "scheduler_steps": progress.scheduler_steps,
        "hooks": recorder.calls,
        "validation": recorder.validation,
        "monitored": monitored,
    }


#: The single-process runs (:func:`train`'s keywords) that the backend modules compare their worlds with;
#: ``tests/conftest.py``'s session fixture ``single_runs`` trains each once per test process.
REFERENCE_RUNS: dict[str, Any] = {
    "fp32": dict,
    "bf16-mixed": lambda: {"precision": "bf16-mixed"},
    "16-mixed": lambda: {"precision": "16-mixed"},
    "bf16-true": lambda: {"precision": "bf16-true"},
    "overflow": lambda: {"precision": "16-mixed", "data": overflow_data(), "max_steps": 8},
}


def sgd(lr: float = 0.05) -> Any:
    return lambda params: torch.optim.SGD(params, lr=lr)


def adamw(lr: float = 1e-2) -> Any:
    return lambda params: torch.optim.AdamW(params, lr=lr)


def fit(trainer: unison.Trainer, *, model: Any = None, data: Any = None, **kwargs: Any) -> unison.Progress:
    """The tests' one fit: ``trainer.fit`` on :func:`mlp` and 64 samples of :func:`regression_data` unless
    given, mean-squared error and SGD (lr 0.05) unless ``loss_fn`` / ``optimizer`` are given; every other
    keyword goes to ``fit`` as is."""
    kwargs.setdefault("loss_fn", torch.nn.functional.mse_loss)
    kwargs.setdefault("optimizer", sgd())
    return trainer.fit(
        model if model is not None else mlp(), data if data is not None else regression_data(n=64), **kwargs
    )


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_matches_single(
    run: dict[str, Any], reference: dict[str, Any], *, tol: float = 1e-6, rel: float = 1e-6
) -> None:
    """A composed strategy's 20-step run (:func:`train`) against the uninterrupted ``single`` one.

    Final weights within ``tol``; the same hooks, monitored values and step counts; every step's global
    grad norm and loss within ``rel``. The reference's norm must exceed the clip value, so clipping clips:
    a norm reduced over too few or too many mesh dimensions changes both the norm and the weights.
    """
    import pytest

    assert max(h["grad_norm"] for h in reference["history"]) > 0.5, "clipping must actually clip"
    assert max_abs_diff(run["state"], reference["state"]) <= tol
    assert run["hooks"] == reference["hooks"] and run["monitored"] == reference["monitored"]
    assert run["optimizer_steps"] == run["scheduler_steps"] == reference["optimizer_steps"]
    for a, b in zip(run["history"], reference["history"], strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=rel)
        assert a["loss"] == pytest.approx(b["loss"], rel=rel)


def suite_report_dir(tmp_path_factory: Any, name: str) -> Any:
    """Where a test's conformance run writes its report: ``$UNISON_CI_REPORTS/NAME`` when set (``.ci/run``
    scores the deliberately broken strategies' reports there: the mutation score), else a temporary directory."""
    import os
    from pathlib import Path

    root = os.environ.get("UNISON_CI_REPORTS")
    if not root:
        return tmp_path_factory.mktemp(name)
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def mutation_suite(
    tmp_path_factory: Any,
    name: str,
    strategies: Any,
    *,
    plugin: str,
    scenarios: Any,
    world_size: int = 2,
    timeout: int = 300,
) -> Any:
    """One suite run of deliberately broken strategies and their control from ``plugin`` (a module-scoped
    fixture's body): certified on ``scenarios``, the report written where :func:`suite_report_dir` says."""
    from unison.conformance.certification import certify
    from unison.conformance.suite import Suite

    with Suite(
        world_size=world_size,
        scenarios=list(scenarios),
        plugins=[plugin],
        timeout=timeout,
        workdir=tmp_path_factory.mktemp(f"conformance-{name}"),
    ) as suite:
        return certify(list(strategies), suite=suite, report_dir=suite_report_dir(tmp_path_factory, name))


def assert_diagnosed(report: Any, name: str, scenario: str, rule: str, *, categorical: bool = False) -> None:
    """``name`` failed ``scenario``, diagnosed ``rule``, not certified; the deciding check at least 10x outside
    its tolerance (or, with ``categorical``, no numeric check deciding: margin ``None``)."""
    from unison.conformance.verdict import FAIL

    v = report.verdicts[name][scenario]
    assert v.status == FAIL, v.summary()
    assert v.diagnosis is not None and v.diagnosis.rule == rule, v.diagnosis and v.diagnosis.message()
    if not (categorical and v.margin is None):
        assert v.margin is not None and v.margin >= 10, (v.margin, v.divergences[0].message())
    assert not report.certificate(name).certified


def assert_mutation_score(report: Any, expected: dict[str, tuple[str, str]], control: str) -> Any:
    """The mutation score over ``expected`` (name -> (scenario, rule)): every one caught and diagnosed with
    its rule, the control certified. Returns the :class:`~unison.conformance.mutation.MutationScore` (its
    line printed)."""
    from unison.conformance.mutation import score
    from unison.conformance.report import _sanitize

    rules = {name: rule for name, (_, rule) in expected.items()}
    result = score(_sanitize(report.to_dict()), list(expected), controls=[control], rules=rules)
    line = result.line()
    print(line)
    assert result.ok and len(result.caught) == len(expected), line
    assert f"diagnoses {len(expected)} of {len(expected)} right" in line, line
    return result
