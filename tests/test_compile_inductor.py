"""compile=True with torch's default backend, inductor, in one process (long tier: code generation).

The quick tier compiles with ``aot_eager`` (tests/test_module_features.py); the conformance suite's
``compile`` scenario certifies inductor on single, ddp and fsdp against the reference.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import unison

import helpers
from helpers import max_abs_diff, mlp, regression_data

pytestmark = pytest.mark.timeout(600)


def fit(**options) -> dict[str, torch.Tensor]:
    trainer = unison.Trainer(
        max_steps=6, global_batch_size=32, accumulate_grad_batches=2, progress="off", loggers=False, **options
    )
    helpers.fit(trainer, model=mlp, data=regression_data(), optimizer=torch.optim.AdamW)
    return trainer.full_state_dict()


def test_inductor_trains_like_eager_and_activation_checkpointing_composes():
    plain = fit()
    counters.clear()
    compiled = fit(compile=True)
    assert counters["inductor"] and counters["frames"]["ok"] >= 1  # inductor, not a fallback
    assert max_abs_diff(plain, compiled) < 1e-6
    both = fit(compile={"mode": "default"}, activation_checkpointing="full")
    assert max_abs_diff(plain, both) < 1e-6
