"""compile and activation_checkpointing as declared features (one process).

Compilation here uses the ``aot_eager`` backend (dynamo and AOT autograd, no code generation: seconds);
inductor, the default, is certified by the conformance suite's ``compile`` scenario and by
tests/test_compile_inductor.py in the long tier.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import unison
from unison.contract.transforms import checkpoint_blocks, model_blocks
from unison.errors import DeclaredRefusal
from unison.plugins.callbacks import Throughput

from helpers import max_abs_diff, mlp, regression_data

pytestmark = pytest.mark.timeout(180)


def fit(*, throughput: Throughput | None = None, model=None, **options) -> tuple[unison.Trainer, dict]:
    trainer = unison.Trainer(
        max_steps=4,
        global_batch_size=32,
        accumulate_grad_batches=2,
        accelerator="cpu",
        progress="off",
        loggers=False,
        callbacks=[throughput] if throughput is not None else [],
        **options,
    )
    trainer.fit(
        model or mlp,
        regression_data(),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    )
    return trainer, trainer.full_state_dict()


class TwoBlocks(torch.nn.Module):
    """A transformer-shaped model: its blocks are the children of ``self.blocks``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)) for _ in range(4)
        )
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def test_compile_trains_the_same_under_the_same_names_and_compiles():
    _, plain = fit()
    counters.clear()
    _, compiled = fit(compile={"backend": "aot_eager"})
    assert counters["frames"]["ok"] >= 1  # the forward really went through dynamo
    assert list(compiled) == list(plain)  # no _orig_mod. in any name
    assert max_abs_diff(plain, compiled) < 1e-6


def test_activation_checkpointing_is_bit_for_bit_and_recomputes_the_forward():
    without, with_ac = Throughput(), Throughput()
    _, plain = fit(throughput=without, model=TwoBlocks)
    _, checkpointed = fit(throughput=with_ac, model=TwoBlocks, activation_checkpointing="full")
    assert max_abs_diff(plain, checkpointed) == 0.0
    # Each block's first Linear runs again in backward (its second Linear's input is recomputed; the
    # second's own output is not needed): 2 * 256 FLOPs per sample per block, 32 samples per step.
    assert with_ac.flops_per_step - without.flops_per_step == 4 * 2 * 256 * 32


def test_the_blocks_and_the_selective_policy():
    seq = mlp()
    assert [n for n, _ in model_blocks(seq)] == ["0", "2", "4"]  # the Tanh children hold no parameters
    assert checkpoint_blocks(seq, "selective:2") == ["2"]
    model = TwoBlocks()
    assert [n for n, _ in model_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert checkpoint_blocks(model, "selective:2") == ["blocks.1", "blocks.3"]
    _, plain = fit(model=TwoBlocks)
    _, selective = fit(model=TwoBlocks, activation_checkpointing="selective:2")
    assert max_abs_diff(plain, selective) == 0.0


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps from one forward for its backward (what checkpointing frees)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return total


def test_activation_checkpointing_keeps_only_the_block_inputs():
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    plain = saved_activation_bytes(TwoBlocks(), x)
    model = TwoBlocks()
    checkpoint_blocks(model, "full")
    # The outer hooks see what autograd keeps across the forward; inside a checkpointed block nothing is kept.
    assert saved_activation_bytes(model, x) < plain / 2


def test_an_unknown_compile_argument_is_refused_by_name():
    with pytest.raises(unison.ConfigurationError, match=r"^compile: \['mod'\] is not torch.compile"):
        unison.Trainer(max_steps=1, compile={"mod": "default"})


def test_an_unknown_checkpointing_policy_is_refused_by_name():
    with pytest.raises(unison.ConfigurationError, match=r"^activation_checkpointing: .*\"selective:N\""):
        unison.Trainer(max_steps=1, activation_checkpointing="every-other")


def test_checkpointing_a_model_without_blocks_is_refused_before_any_process_group():
    trainer = unison.Trainer(max_steps=1, activation_checkpointing="full", progress="off", loggers=False)

    class NoBlocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.layer(x)

    with pytest.raises(unison.ConfigurationError, match=r"^activation_checkpointing: NoBlocks has no blocks"):
        trainer.fit(NoBlocks(), regression_data(), loss_fn=torch.nn.functional.mse_loss, optimizer=torch.optim.SGD)
    assert not trainer.setup_started


@pytest.mark.parametrize(
    ("strategy", "world", "option", "value"),
    [
        ("fsdp1", 2, "compile", True),
        ("zero2", 2, "activation_checkpointing", "full"),
        ("pipeline", 2, "compile", True),
        ("deepspeed_pipeline", 2, "activation_checkpointing", "full"),
    ],
)
def test_a_strategy_that_declares_a_feature_refused_refuses_it_naming_the_option(
    monkeypatch, strategy, world, option, value
):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(DeclaredRefusal) as raised:
        unison.Trainer(strategy=strategy, max_steps=1, global_batch_size=8, **{option: value})
    assert raised.value.option == option and raised.value.feature == option
    assert f"set {option}=" in str(raised.value) and f"unison describe {strategy}" in str(raised.value)


# -- the conformance probes see a strategy that ignores the option ------------------------------- #


def probed_fit(scenario, **options) -> dict:
    """One single-process fit of the scenario's model under the suite's probe, as a trace."""
    from unison.conformance.feature_probes import FeatureProbe
    from unison.conformance.models import build_model

    with FeatureProbe(scenario.probe) as probe:
        fit(model=lambda: build_model(scenario.model), **options)
    return {"status": "ok", "feature_probe": probe.result()}


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("compile", {"compile": {"backend": "aot_eager"}}),
        ("activation_checkpointing", {"activation_checkpointing": "full"}),
    ],
)
def test_the_suite_probe_fails_a_run_that_ignored_the_feature(name, options):
    from unison.conformance.checks.numeric import Checker
    from unison.conformance.feature_probes import check_feature_probe
    from unison.conformance.scenarios import SCENARIOS_BY_NAME
    from unison.conformance.verdict import tolerance_for

    scenario = SCENARIOS_BY_NAME[name]
    reference = probed_fit(scenario)
    applied, ignored = probed_fit(scenario, **options), probed_fit(scenario)  # what an ignoring strategy runs
    # One process stands for a world of one rank here; two ranks applying it would be two records.
    for trace, failures in ((applied, 0), (ignored, 1)):
        checker = Checker(scenario, tolerance_for(scenario.precision))
        check_feature_probe(checker, scenario, "strategy:main", trace, reference)
        assert [d.kind for d in checker.divergences] == ["feature"] * failures, checker.divergences
