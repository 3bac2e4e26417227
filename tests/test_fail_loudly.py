"""No silent wrong result: non-finite steps stop the run, bad input is refused before any process group."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

import unison
from unison.checkpointing.checkpointer import Checkpointer

from helpers import fit, mlp, regression_data


def poisoned_data(n: int = 64, index: int = 40, value: float = math.nan) -> TensorDataset:
    """Regression data whose sample ``index`` has a non-finite input (shuffle off: step index // 16)."""
    x, y = regression_data(n=n).tensors
    x = x.clone()
    x[index] = value
    return TensorDataset(x, y)


def _all_finite(path: Path) -> bool:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path / "state"), str(path.parent / "as_torch.pt"))
    state = torch.load(path.parent / "as_torch.pt", weights_only=True)
    (path.parent / "as_torch.pt").unlink()
    tensors = [v for v in state["model"].values() if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(bool(torch.isfinite(t).all()) for t in tensors)


# --------------------------------------------------------------------------- #
# The non-finite guard
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_loss_stops_the_run_at_that_step_without_a_bad_checkpoint(tmp_path, precision, value):
    trainer = unison.Trainer(
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=4,
        shuffle=False,
        precision=precision,
        checkpoint_dir=str(tmp_path),
        checkpoint_every_n_steps=1,
        keep_last_n_checkpoints=1,
    )
    with pytest.raises(
        unison.NonFiniteError, match=r"step 2: the loss was non-finite first at micro-batch 1 on rank 0"
    ):
        fit(trainer, data=poisoned_data(index=40, value=value))  # step 2 = samples 32..47, micro-batch 1 = 40..47
    # The check is read one step late (no host sync per step): step 2's update ran in memory and is counted,
    # and the error came before its checkpoint.
    assert trainer.progress.global_step == 3 and trainer.progress.optimizer_steps == 3
    latest = Checkpointer(tmp_path).latest()
    assert latest is not None and latest.name.endswith("00000002") and _all_finite(latest)
    # nothing was pruned in favour of a non-finite checkpoint: the one kept is the last good step
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002"]


@pytest.mark.parametrize(("index", "max_steps"), [(40, 4), (56, 4)], ids=["next-step", "last-step"])
def test_a_non_finite_step_that_neither_logs_nor_saves_raises_before_anything_keeps_it(tmp_path, index, max_steps):
    """Read late: in the next step (before its update), or at the end of the loop (before the final save)."""
    seen = []

    class Steps:
        @unison.hookimpl
        def unison_on_train_step_start(self, step):
            seen.append(step)

    trainer = unison.Trainer(
        global_batch_size=16,
        max_steps=max_steps,
        shuffle=False,
        log_every_n_steps=100,
        progress="off",
        checkpoint_dir=str(tmp_path),
        callbacks=[Steps()],
    )
    step = index // 16
    with pytest.raises(unison.NonFiniteError, match=rf"step {step}: the loss was non-finite first at micro-batch 0"):
        fit(trainer, data=poisoned_data(index=index))
    assert trainer.progress.global_step == step + 1 and seen == list(range(min(step + 2, max_steps)))
    assert list(tmp_path.glob("step-*")) == []  # the end-of-fit save never ran


def test_skip_policy_skips_and_counts_the_step_and_the_scheduler():
    trainer = unison.Trainer(global_batch_size=16, max_steps=4, shuffle=False, nonfinite="skip")
    progress = fit(
        trainer,
        data=poisoned_data(index=20),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )
    assert [h.skipped for h in progress.history] == [False, True, False, False]
    assert progress.skipped_steps == 1 and progress.optimizer_steps == progress.scheduler_steps == 3
    assert all(torch.isfinite(t).all() for t in trainer.full_state_dict().values())


def test_continue_policy_trains_on_as_asked():
    trainer = unison.Trainer(global_batch_size=16, max_steps=2, shuffle=False, nonfinite="continue")
    fit(trainer, data=poisoned_data(index=0))
    assert not all(torch.isfinite(t).all() for t in trainer.full_state_dict().values())


def test_fp16_skips_overflows_but_not_forever():
    # Every sample is NaN: GradScaler would skip every step forever; the trainer stops after the limit.
    x, y = regression_data(n=64).tensors
    data = TensorDataset(torch.full_like(x, math.nan), y)
    trainer = unison.Trainer(global_batch_size=16, max_steps=50, precision="16-mixed", max_consecutive_skips=5)
    with pytest.raises(unison.NonFiniteError, match="step 4: 5 optimizer steps in a row were skipped"):
        fit(trainer, data=data)
    assert trainer.progress.optimizer_steps == 0 and trainer.progress.skipped_steps == 5


# --------------------------------------------------------------------------- #
# Bad input, each refused before any process group with a message naming the option
# --------------------------------------------------------------------------- #


def _refused(option_match: str, trainer_kwargs: dict | None = None, **fit_kwargs):
    trainer = unison.Trainer(**{"global_batch_size": 16, "max_steps": 2, **(trainer_kwargs or {})})
    with pytest.raises(unison.ConfigurationError, match=option_match):
        fit(trainer, **fit_kwargs)
    assert not torch.distributed.is_initialized() and not trainer.setup_started


def test_an_optimizer_factory_that_ignores_its_params_is_refused():
    other = torch.nn.Linear(3, 3)
    _refused(
        r"optimizer: the optimizer holds 0 of the 6 trainable parameters",
        optimizer=lambda params: torch.optim.SGD(other.parameters(), lr=0.1),
    )


@pytest.mark.parametrize("returned", ["adam", None, 3])
def test_an_optimizer_factory_returning_something_else(returned):
    _refused(r"optimizer: the optimizer factory returned", optimizer=lambda params: returned)


def test_an_optimizer_instance_instead_of_a_factory():
    _refused(
        r"optimizer: .*callable|optimizer: .*cannot be called",
        optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
    )


def test_a_scheduler_factory_returning_a_number():
    _refused(r"lr_scheduler: the scheduler factory returned float", lr_scheduler=lambda opt: 0.5)


def test_a_model_without_trainable_parameters():
    model = mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    _refused(r"model: Sequential has no trainable parameters", model=model)


@pytest.mark.parametrize("loss", [lambda out, y: (out - y) ** 2, lambda out, y: 0.5])
def test_a_loss_that_is_not_a_scalar_tensor(loss):
    trainer = unison.Trainer(global_batch_size=16, max_steps=2)
    with pytest.raises(unison.ConfigurationError, match=r"loss_fn returned .*scalar tensor"):
        fit(trainer, loss_fn=loss)


@pytest.mark.parametrize(
    "bad",
    [{"global_batch_size": True}, {"shuffle": "yes"}, {"max_steps": "3"}, {"grad_clip_norm": False}, {"seed": 1.5}],
)
def test_no_coercion_of_bools_and_strings(bad):
    with pytest.raises(unison.ConfigurationError) as info:
        unison.Trainer(**{"max_steps": 2, **bad})
    assert info.value.option == next(iter(bad))


def test_strategy_options_are_strict_too():
    with pytest.raises(unison.ConfigurationError, match="static_graph"):
        unison.Trainer(strategy="ddp", strategy_options={"static_graph": "yes"}, max_steps=1)


def test_an_empty_validation_set():
    _refused(r"val_dataset: the validation dataset is empty", val_dataset=[])


def test_an_unwritable_checkpoint_dir_is_refused_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    trainer = unison.Trainer(global_batch_size=16, max_steps=2, checkpoint_dir=str(blocker / "ckpt"))
    with pytest.raises(unison.ConfigurationError, match=r"checkpoint_dir.*cannot be written") as info:
        fit(trainer)
    assert not trainer.setup_started and "choose a directory" in str(info.value)


@pytest.mark.parametrize("where", ["missing", "not-a-checkpoint"])
def test_a_ckpt_path_pointing_nowhere_is_refused_before_setup(tmp_path, where):
    path = tmp_path / where
    if where == "not-a-checkpoint":
        path.mkdir()
    for checkpoint_dir in (None, str(tmp_path / "ckpt")):
        trainer = unison.Trainer(global_batch_size=16, max_steps=2, checkpoint_dir=checkpoint_dir)
        with pytest.raises(unison.ConfigurationError, match=r"ckpt_path.*(does not exist|no manifest\.json)"):
            fit(trainer, ckpt_path=str(path))
        assert not trainer.setup_started


@pytest.mark.parametrize("how", ["path", "auto", "last"])
def test_max_steps_below_the_resumed_step_is_refused_before_setup(tmp_path, how):
    fit(unison.Trainer(global_batch_size=16, max_steps=3, checkpoint_dir=str(tmp_path)))
    ckpt_path = str(tmp_path / "step-00000003") if how == "path" else how
    trainer = unison.Trainer(global_batch_size=16, max_steps=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(unison.ConfigurationError, match=r"max_steps.*resumes at step 3, beyond max_steps=2"):
        fit(trainer, ckpt_path=ckpt_path)
    assert not trainer.setup_started
    # at max_steps it resumes and has nothing left to do
    done = unison.Trainer(global_batch_size=16, max_steps=3, checkpoint_dir=str(tmp_path))
    assert fit(done, ckpt_path=ckpt_path).global_step == 3


def test_cuda_on_a_build_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(unison.ConfigurationError, match=r"accelerator: accelerator='cuda' but"):
        unison.Trainer(accelerator="cuda", max_steps=1)


def test_unknown_strategy_suggests_the_near_miss():
    with pytest.raises(unison.UnknownStrategyError, match="did you mean 'ddp'"):
        unison.Trainer(strategy="dpp", max_steps=1)


# --------------------------------------------------------------------------- #
# Property: invalid settings are refused, valid ones accepted, never a process group
# --------------------------------------------------------------------------- #

_VALID = {
    "strategy": st.sampled_from(["single", "ddp", "fsdp"]),
    "precision": st.sampled_from(["32-true", "bf16-mixed", "bf16-true", "16-mixed"]),
    "accumulate_grad_batches": st.sampled_from([1, 2, 4]),
    "max_steps": st.integers(1, 1000),
    "grad_clip_norm": st.one_of(st.none(), st.floats(0.01, 10.0)),
    "seed": st.integers(0, 2**31),
    "shuffle": st.booleans(),
    "num_workers": st.integers(0, 4),
}
_INVALID_VALUES = {
    "accumulate_grad_batches": st.one_of(st.integers(-5, 0), st.booleans(), st.text(max_size=3), st.floats()),
    "global_batch_size": st.one_of(st.integers(-5, 0), st.booleans(), st.text(max_size=3)),
    "max_steps": st.one_of(st.integers(-5, 0), st.booleans(), st.text(max_size=3)),
    "grad_clip_norm": st.one_of(st.floats(-10, 0), st.booleans(), st.text(max_size=3)),
    "shuffle": st.one_of(st.integers(), st.text(max_size=3)),
    "precision": st.text(min_size=1, max_size=8).filter(
        lambda s: s not in ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
    ),
    "strategy": st.text(min_size=1, max_size=8).filter(
        lambda s: s not in ("single", "ddp", "fsdp", "fsdp1", "pipeline")
    ),
    "num_workers": st.one_of(st.integers(-5, -1), st.booleans()),
    "log_every_n_steps": st.one_of(st.integers(-5, 0), st.text(max_size=3)),
    "accelerator": st.text(max_size=5).filter(lambda s: s not in ("auto", "cpu", "cuda")),
    "no_such_setting": st.integers(),
}


@given(valid=st.fixed_dictionaries(_VALID), bad=st.sampled_from(sorted(_INVALID_VALUES)), data=st.data())
@settings(max_examples=60, deadline=None)
def test_property_invalid_settings_are_refused_before_any_process_group(valid, bad, data):
    valid = {**valid, "global_batch_size": valid["accumulate_grad_batches"] * 8}
    if valid["strategy"] == "fsdp" and valid["precision"] == "bf16-true":
        pass  # supported, fine
    trainer = unison.Trainer(**valid)  # valid settings are accepted
    assert trainer.settings.max_steps == valid["max_steps"]
    settings_ = {**valid, bad: data.draw(_INVALID_VALUES[bad])}
    with pytest.raises(unison.ConfigurationError):
        unison.Trainer(**settings_)
    assert not torch.distributed.is_initialized()


def test_property_invalid_config_files_are_refused(tmp_path):
    from unison.config.load import load_config

    root = Path(__file__).resolve().parents[1] / "examples" / "tinylm.toml"
    text = root.read_text()
    cases = {
        "max_steps = 150": "max_steps = -1",
        "global_batch_size = 16": "global_batch_size = true",
        "[loss]": "[losss]",
        'strategy = "single"': 'strategy = "single"\nshuffle = "yes"',
    }
    for old, new in cases.items():
        cfg = tmp_path / "bad.toml"
        cfg.write_text(text.replace(old, new))
        with pytest.raises(unison.ConfigurationError, match="config key"):
            load_config(cfg)


def test_every_strategy_that_runs_on_one_process_runs_without_a_launcher(tmp_path):
    """The README's promise: one process, no torchrun, for every strategy whose world sizes include 1."""
    import subprocess
    import sys

    script = tmp_path / "one_process.py"
    script.write_text(
        "import os, torch, unison\n"
        "from unison.plugin.manager import PluginManager\n"
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from helpers import mlp, regression_data\n"
        "pm = PluginManager()\n"
        "ran = []\n"
        "for spec in pm.strategies.specs():\n"
        "    own = pm.strategies.create(spec.name).ownership if not spec.unavailable else None\n"
        "    if own is None or own.world_sizes.minimum > 1:\n"
        "        continue\n"
        "    t = unison.Trainer(strategy=spec.name, global_batch_size=8, max_steps=2, progress='off')\n"
        "    t.fit(mlp(), regression_data(n=16), loss_fn=torch.nn.functional.mse_loss,\n"
        "          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))\n"
        "    assert t.progress.global_step == 2 and not torch.distributed.is_initialized()\n"
        "    ran.append(spec.name)\n"
        "print('RAN', ' '.join(ran))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env={**env, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ran = out.stdout.split("RAN", 1)[1].split()
    assert {"single", "ddp", "fsdp", "fsdp1", "zero1", "zero2", "zero3", "torch_zero"} <= set(ran), ran
