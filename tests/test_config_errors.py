"""Config mistakes: every one reported at once, each with its file and line (or override), key and fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import unison
from unison.config.load import ConfigErrors, load_config

pytestmark = pytest.mark.timeout(120)

FACTORIES = """
import torch

def model(width=4):
    return torch.nn.Linear(width, 1)

def datasets(n=8):
    x = torch.randn(n, 4)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), None

def loss(out, y):
    return torch.nn.functional.mse_loss(out, y)
"""

# Line numbers below refer to this text (line 1 is "[trainer]").
BASE = """\
[trainer]
max_steps = 2
global_batch_size = 4
progress = "off"

[model]
factory = "factories.py:model"
kwargs = { width = 4 }

[data]
factory = "factories.py:datasets"

[loss]
factory = "factories.py:loss"

[optimizer]
name = "SGD"
kwargs = { lr = 0.1, momentum = 0.9 }

[scheduler]
name = "StepLR"
kwargs = { step_size = 1 }

[logging]
dir = "runs"

[[callbacks]]
factory = "unison.plugins.callbacks:EarlyStopping"
kwargs = { monitor = "val/loss", patience = 2 }
"""


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    (tmp_path / "factories.py").write_text(FACTORIES)
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_base_config_is_valid(tmp_path):
    config, base = load_config(write(tmp_path, BASE))
    assert config.optimizer.kwargs == {"lr": 0.1, "momentum": 0.9} and base == tmp_path.resolve()


# (old text, new text, line, key, what the message must say: the closest name or the type)
MISTAKES = {
    "trainer key": ("max_steps = 2", "max_step = 2", 2, "trainer.max_step", "did you mean 'max_steps'"),
    "trainer type": ("global_batch_size = 4", 'global_batch_size = "4"', 3, "trainer.global_batch_size", "integer"),
    "trainer value": ('progress = "off"', 'progress = "of"', 4, "trainer.progress", "'auto', 'rich', 'plain' or 'off'"),
    "model key": ('factory = "factories.py:model"', 'factroy = "factories.py:model"', 7, "model.factroy", "'factory'"),
    "model kwarg": ("{ width = 4 }", "{ widht = 4 }", 8, "model.kwargs.widht", "did you mean 'width'"),
    "data factory": ("factories.py:datasets", "factories.py:dataset", 11, "data.factory", "did you mean 'datasets'"),
    "section": ("[loss]", "[los]", 13, "los", "unknown section (did you mean 'loss'"),
    "optimizer name": ('name = "SGD"', 'name = "SDG"', 17, "optimizer.name", "did you mean 'SGD'"),
    "optimizer kwarg": ("momentum = 0.9", "momentun = 0.9", 18, "optimizer.kwargs.momentun", "'momentum'"),
    "optimizer value": ("momentum = 0.9", "momentum = -0.9", 18, "optimizer.kwargs.momentum", "negative"),
    "scheduler name": ('name = "StepLR"', 'name = "StepLRR"', 21, "scheduler.name", "did you mean 'StepLR'"),
    "scheduler kwarg": ("step_size = 1", "step_sise = 1", 22, "scheduler.kwargs.step_sise", "'step_size'"),
    "logging key": ('dir = "runs"', 'dri = "runs"', 25, "logging.dri", "did you mean 'dir'"),
    "callback factory": ("EarlyStopping", "EarlyStoping", 28, "callbacks.0.factory", "'EarlyStopping'"),
    "callback kwarg": ("patience = 2", "patiense = 2", 29, "callbacks.0.kwargs.patiense", "'patience'"),
}

#: Mistakes that make a second problem: a misspelled required key leaves the key missing (named at its table).
ALSO = {"model key": [(6, "model.factory")]}


@pytest.mark.parametrize("case", MISTAKES, ids=list(MISTAKES))
def test_each_mistake_is_named_with_its_line_key_and_suggestion(tmp_path, case):
    old, new, line, key, says = MISTAKES[case]
    assert BASE.count(old) == 1
    path = write(tmp_path, BASE.replace(old, new))
    with pytest.raises(ConfigErrors) as raised:
        load_config(path)
    also = [(f"{path}:{n}", k) for n, k in ALSO.get(case, [])]
    assert [(place, k) for place, k, _, _ in raised.value.problems] == sorted([*also, (f"{path}:{line}", key)])
    assert says in str(raised.value)
    assert f"{path}:{line}: config key {key}: " in str(raised.value)
    assert isinstance(raised.value, unison.ConfigurationError)  # the CLI exits 2 on it


def test_an_unknown_imports_key_is_named(tmp_path):
    path = write(tmp_path, BASE + '\n[imports]\nallwo = ["x"]\n')
    with pytest.raises(ConfigErrors, match=rf"{path}:32: config key imports.allwo: .*did you mean 'allow'"):
        load_config(path)


def test_several_mistakes_in_one_file_are_reported_together_in_file_order(tmp_path):
    text = BASE
    for case in ("callback kwarg", "trainer key", "optimizer kwarg", "model kwarg", "section", "scheduler kwarg"):
        old, new, *_ = MISTAKES[case]
        text = text.replace(old, new)
    path = write(tmp_path, text)
    with pytest.raises(ConfigErrors) as raised:
        load_config(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: 6 problems in the config\n")
    expected = [
        (2, "trainer.max_step", "'max_steps'"),
        (8, "model.kwargs.widht", "'width'"),
        (13, "los", "'loss'"),
        (18, "optimizer.kwargs.momentun", "'momentum'"),
        (22, "scheduler.kwargs.step_sise", "'step_size'"),
        (29, "callbacks.0.kwargs.patiense", "'patience'"),
    ]
    body = message.splitlines()[1:]
    assert len(body) == len(expected)
    for text_line, (line, key, suggestion) in zip(body, expected, strict=True):
        assert text_line.startswith(f"  {path}:{line}: config key {key}: ") and suggestion in text_line


def test_nan_and_negative_learning_rates_are_named(tmp_path):
    for lr, says in (
        ("nan", "nan is not a finite number"),
        ("-0.1", "must not be negative"),
        ("inf", "inf is not a finite number"),
    ):
        path = write(tmp_path, BASE.replace("lr = 0.1", f"lr = {lr}"))
        with pytest.raises(ConfigErrors, match=rf"{path}:18: config key optimizer.kwargs.lr: {says}"):
            load_config(path)


def test_what_torch_refuses_is_named_with_its_key(tmp_path):
    text = BASE.replace('name = "SGD"', 'name = "AdamW"').replace("momentum = 0.9", "betas = [0.9, 1.5]")
    path = write(tmp_path, text)
    with pytest.raises(ConfigErrors, match=rf"{path}:18: config key optimizer.kwargs.betas: refused by the class"):
        load_config(path)


def test_yaml_mistakes_carry_their_lines(tmp_path):
    text = textwrap.dedent("""\
        trainer:
          max_steps: 2
          global_batch_sise: 4
        model:
          factory: factories.py:model
        data:
          factory: factories.py:datasets
        loss:
          factory: factories.py:loss
        optimizer:
          name: SGD
          kwargs:
            lr: 0.1
            weight_decy: 0.1
        """)
    path = write(tmp_path, text, "run.yaml")
    with pytest.raises(ConfigErrors) as raised:
        load_config(path)
    assert [(p, k) for p, k, _, _ in raised.value.problems] == [
        (f"{path}:3", "trainer.global_batch_sise"),
        (f"{path}:14", "optimizer.kwargs.weight_decy"),
    ]
    assert "'global_batch_size'" in str(raised.value) and "'weight_decay'" in str(raised.value)


# -- command-line overrides ------------------------------------------------------------------ #
def test_overrides_reach_any_key(tmp_path):
    config, _ = load_config(
        write(tmp_path, BASE),
        sets=[
            "trainer.checkpoint_dir=runs/b",
            "trainer.nonfinite=skip",
            "optimizer.kwargs.lr=3e-4",
            "callbacks.0.kwargs.patience=7",
            "scheduler.kwargs={ step_size = 3, gamma = 0.5 }",
            "trainer.max_steps=5",
        ],
    )
    assert config.trainer.checkpoint_dir == "runs/b" and config.trainer.nonfinite == "skip"
    assert config.optimizer.kwargs == {"lr": 3e-4, "momentum": 0.9}
    assert config.callbacks[0].kwargs["patience"] == 7 and config.trainer.max_steps == 5
    assert config.scheduler is not None and config.scheduler.kwargs == {"step_size": 3, "gamma": 0.5}


def test_an_override_inside_a_default_section_edits_the_default(tmp_path):
    text = BASE.split("[optimizer]")[0]  # no [optimizer] section: AdamW with lr 1e-3
    config, _ = load_config(write(tmp_path, text), sets=["optimizer.kwargs.weight_decay=0.1"])
    assert (config.optimizer.name, config.optimizer.kwargs) == ("AdamW", {"lr": 1e-3, "weight_decay": 0.1})


def test_a_bad_override_is_named_as_the_override(tmp_path):
    path = write(tmp_path, BASE)
    with pytest.raises(ConfigErrors) as raised:
        load_config(path, sets=["trainer.max_step=5", "optimizer.kwargs.lr=-1", "scheduler.kwargs={ step = 1 }"])
    assert [(p, k) for p, k, _, _ in raised.value.problems] == [
        ("--set trainer.max_step=5", "trainer.max_step"),
        ("--set optimizer.kwargs.lr=-1", "optimizer.kwargs.lr"),
        ("--set scheduler.kwargs={ step = 1 }", "scheduler.kwargs.step"),
    ]
    assert "did you mean 'max_steps'" in str(raised.value)


@pytest.mark.parametrize(
    "item,says",
    [
        ("max_steps", "KEY=VALUE"),
        ("callbacks.3.kwargs.patience=1", "callbacks.3 does not exist"),
        ("trainer.max_steps.x=1", "trainer.max_steps is not a table"),
    ],
)
def test_malformed_overrides_are_refused(tmp_path, item, says):
    with pytest.raises(unison.ConfigurationError, match=rf"--set {item}.*{says}"):
        load_config(write(tmp_path, BASE), sets=[item])


def test_a_trainer_option_given_as_a_section_points_to_trainer(tmp_path):
    with pytest.raises(ConfigErrors, match=r"config key max_steps: unknown section.*write trainer\.max_steps"):
        load_config(write(tmp_path, BASE), sets=["max_steps=3"])


# -- docs/config.md: its blocks are what the code does ----------------------------------------- #
DOC = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()


def _blocks(kind: str) -> list[str]:
    return [b.split("\n", 1)[1] for b in DOC.split("```")[1::2] if b.startswith(kind + "\n")]


def test_the_docs_config_loads_and_its_error_example_is_the_real_output(tmp_path):
    full, imports = _blocks("toml")
    shown = _blocks("text")[0].strip().splitlines()
    path = write(tmp_path, full)
    config, _ = load_config(path)
    assert config.trainer.nonfinite == "skip" and config.callbacks[0].kwargs["patience"] == 3
    mistakes = {"max_steps": "max_step", "weight_decay =": "weight_decy =", "step_size": "step_sise"}
    for old, new in mistakes.items():
        full = full.replace(old, new)
    path.write_text(full)
    with pytest.raises(ConfigErrors) as raised:
        load_config(path)
    real = str(raised.value).replace(str(path), "run.toml").splitlines()
    assert len(real) == len(shown)
    for real_line, shown_line in zip(real, shown, strict=True):
        # the docs shorten long keyword lists with "..."
        assert real_line.startswith(shown_line.removesuffix("...").removesuffix(", ")), (real_line, shown_line)
    path.write_text(imports + _blocks("toml")[0])
    loaded, _ = load_config(path)
    assert loaded.imports.allow == ["transformers", "torch.nn"] and loaded.imports.paths == ["../shared"]
