"""Trainer's typed signature: every TrainerSettings field, with its default and a documented line."""

from __future__ import annotations

import inspect

import pytest

import unison
from unison.contract.settings import TrainerSettings

pytestmark = pytest.mark.timeout(60)

PARAMS = inspect.signature(unison.Trainer.__init__).parameters


def test_every_setting_is_a_typed_keyword_with_the_same_default():
    for name, field in TrainerSettings.model_fields.items():
        param = PARAMS[name]
        assert param.kind is param.KEYWORD_ONLY and param.annotation is not param.empty, name
        default = field.get_default(call_default_factory=True)
        # strategy_options' default is None in the signature (no shared mutable default), {} in the settings
        assert param.default == default or (name == "strategy_options" and param.default is None), name


def test_every_option_has_a_line_in_the_docstring():
    doc = unison.Trainer.__doc__
    for name in PARAMS:
        if name not in ("self", "unknown"):
            assert f"\n        {name}: " in doc, f"{name} is not documented in Trainer's Args"


def test_a_misspelled_option_is_a_configuration_error_with_the_closest_name():
    with pytest.raises(unison.ConfigurationError, match=r"max_step: unknown option \(did you mean 'max_steps'\?\)"):
        unison.Trainer(max_step=30)


def test_every_bad_value_is_reported_together():
    with pytest.raises(unison.ConfigurationError) as raised:
        unison.Trainer(max_steps=0, nonfinite="ignore", max_consecutive_skips=True)
    text = str(raised.value)
    assert "max_steps:" in text and "nonfinite:" in text and "max_consecutive_skips:" in text


def test_nonfinite_and_skips_are_settings():
    trainer = unison.Trainer(max_steps=1, nonfinite="skip", max_consecutive_skips=3)
    assert (trainer.nonfinite, trainer.max_consecutive_skips) == ("skip", 3)
    assert trainer.settings.nonfinite == "skip"
    assert unison.Trainer(**trainer.settings.model_dump()).settings == trainer.settings
