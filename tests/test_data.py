"""The data path in one process: batch structures, sources, loader workers, seeding, bad input."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset

import unison
from unison.data.batch import batch_size, count_tokens, map_tensors, move_to_device, split_batch
from unison.data.plan import local_slices
from unison.data.streams import stream_global_batches

from data_worlds import NestedDataset, NestedStream, build_model, fit, nested_step
from helpers import max_abs_diff, mlp, regression_data


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


# --------------------------------------------------------------------------- #
# Batch structures
# --------------------------------------------------------------------------- #

Pair = collections.namedtuple("Pair", "a b")


def test_map_tensors_keeps_containers_and_non_tensor_leaves():
    batch = {"x": torch.ones(2, 3), "pair": Pair(torch.zeros(2), "text"), "list": [torch.ones(2, 1), 3]}
    out = map_tensors(lambda t: t * 2, batch)
    assert isinstance(out["pair"], Pair) and out["pair"].b == "text" and out["list"][1] == 3
    assert torch.equal(out["x"], torch.full((2, 3), 2.0))
    assert move_to_device(batch, torch.device("cpu"))["pair"].b == "text"


def test_batch_size_agrees_or_names_the_leaf():
    assert batch_size({"a": torch.ones(4, 2), "b": [torch.zeros(4)], "c": torch.tensor(1.0), "d": "x"}) == 4
    with pytest.raises(
        unison.ConfigurationError, match=r"batch\['b'\]\[0\] has 3 rows along dim 0 but batch\['a'\] has 4"
    ):
        batch_size({"a": torch.ones(4, 2), "b": [torch.zeros(3)]})


def test_split_batch_cuts_every_leaf_along_the_batch_dimension():
    batch = {"x": torch.arange(8).reshape(4, 2), "scale": torch.tensor(2.0), "name": "n"}
    parts = split_batch(batch, 2)
    assert [p["x"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert all(p["scale"] == 2.0 and p["name"] == "n" for p in parts)


def test_token_rule():
    ids = torch.ones(2, 5, dtype=torch.long)
    assert count_tokens({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1] * 5])}) == 8
    assert count_tokens({"input_ids": ids}) == 10
    assert count_tokens((ids, ids)) == 10
    assert count_tokens((torch.randn(2, 5), torch.randn(2))) is None


@given(n_steps=st.integers(1, 4), accumulate=st.sampled_from([1, 2, 4]), replicas=st.sampled_from([1, 2, 4]))
@settings(max_examples=30, deadline=None)
def test_stream_slices_reassemble_into_the_global_batch(n_steps, accumulate, replicas):
    gbs = accumulate * replicas * 2
    stream = list(range(n_steps * gbs + gbs - 1))  # plus an incomplete last global batch, dropped
    batches = list(stream_global_batches(stream, gbs, end_epoch=1))
    assert len(batches) == n_steps
    for step, epoch, samples in batches:
        parts = [local_slices(samples, accumulate, replicas, r) for r in range(replicas)]
        # micro-batch m, all replicas in rank order, is the m-th cut of the global batch
        rebuilt = [x for m in range(accumulate) for r in range(replicas) for x in parts[r][m]]
        assert rebuilt == stream[step * gbs : (step + 1) * gbs] and epoch == 0


# --------------------------------------------------------------------------- #
# Sources, workers, resume (one process)
# --------------------------------------------------------------------------- #


def test_a_dataloader_contributes_its_dataset_collate_fn_and_workers():
    calls = []

    def collate(samples):
        calls.append(len(samples))
        return torch.utils.data.default_collate(samples)

    loader = DataLoader(NestedDataset(), batch_size=5, shuffle=True, collate_fn=collate)  # batch_size/shuffle replaced
    trainer = unison.Trainer(global_batch_size=16, accumulate_grad_batches=2, max_steps=3, seed=3)
    trainer.fit(build_model, loader, training_step=nested_step, optimizer=_sgd)
    direct = unison.Trainer(global_batch_size=16, accumulate_grad_batches=2, max_steps=3, seed=3)
    direct.fit(build_model, NestedDataset(), training_step=nested_step, optimizer=_sgd)
    assert set(calls[1:]) == {8}  # micro-batches of 16 / 2, after the pre-launch probe
    assert max_abs_diff(trainer.full_state_dict(), direct.full_state_dict()) == 0.0


def test_hugging_face_datasets_map_style_and_streaming_with_workers():
    datasets = pytest.importorskip("datasets")
    data = NestedDataset()
    rows = {"x": data.x.tolist(), "y": data.y.tolist(), "ids": data.ids.tolist(), "w": data.w.tolist()}
    table = datasets.Dataset.from_dict(rows).with_format("torch")

    def step(model, batch):
        out = model(batch["x"], batch["ids"])
        return ((out - batch["y"]).pow(2).squeeze(-1) * batch["w"]).mean()

    def run(source, workers):
        trainer = unison.Trainer(
            global_batch_size=16, accumulate_grad_batches=2, max_steps=6, seed=3, num_workers=workers, shuffle=False
        )
        progress = trainer.fit(build_model, source, training_step=step, optimizer=_sgd)
        return trainer.full_state_dict(), [h.loss for h in progress.history]

    map_state, map_losses = run(table, 0)
    # A streaming dataset of 4 shards read by 2 workers: every worker must read the whole stream
    # (Hugging Face would shard by worker), or the samples would come in another order.
    for workers in (0, 2):
        state, losses = run(table.to_iterable_dataset(num_shards=4), workers)
        assert losses == map_losses and max_abs_diff(state, map_state) == 0.0


def test_resume_mid_epoch_and_mid_stream_is_exact_with_workers(tmp_path):
    for kind in ("map", "iterable"):
        full = fit("single", kind, 2)
        fit("single", kind, 2, max_steps=5, checkpoint_dir=str(tmp_path / kind))
        resumed = fit("single", kind, 2, checkpoint_dir=str(tmp_path / kind), ckpt_path="last")
        assert resumed["steps"] == list(range(5, 12)) and resumed["losses"] == full["losses"][5:]
        assert max_abs_diff(resumed["state"], full["state"]) == 0.0
        assert resumed["epochs"] == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]


def test_max_epochs_with_iterable_data_ends_after_the_passes():
    run = fit("single", "iterable", 0)  # 96 samples / 16 = 6 steps per pass, 2 passes
    assert run["global_step"] == 12 and run["epochs"] == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]


def test_integer_leaves_stay_integer_under_bf16_true():
    trainer = unison.Trainer(precision="bf16-true", global_batch_size=16, max_steps=2)
    trainer.fit(build_model, NestedDataset(), training_step=nested_step, optimizer=_sgd)  # the model asserts it


def test_model_factory_is_seeded_so_reruns_build_identical_weights():
    def run(seed):
        trainer = unison.Trainer(global_batch_size=16, max_steps=2, seed=seed)
        trainer.fit(build_model, NestedDataset(), training_step=nested_step, optimizer=_sgd)
        return trainer.full_state_dict()

    torch.manual_seed(123)  # the caller's RNG state does not matter
    a = run(7)
    torch.manual_seed(456)
    assert max_abs_diff(a, run(7)) == 0.0
    assert max_abs_diff(a, run(8)) > 0


# --------------------------------------------------------------------------- #
# Bad input, refused before any process group
# --------------------------------------------------------------------------- #


def _refused(match, **fit_kwargs):
    trainer = unison.Trainer(global_batch_size=16, accumulate_grad_batches=2, max_steps=2)
    args = {"optimizer": _sgd, **fit_kwargs}
    model = args.pop("model", build_model)
    data = args.pop("data", NestedDataset())
    with pytest.raises(unison.ConfigurationError, match=match):
        trainer.fit(model, data, **args)
    assert not torch.distributed.is_initialized() and not trainer.setup_started


def test_a_batch_the_loss_fn_form_cannot_take():
    _refused(
        r"loss_fn: the loss_fn form needs each batch to be \(inputs, targets\), but the collated batch is a "
        r"dict with keys \['x', 'y', 'meta'\].*training_step=",
        loss_fn=torch.nn.functional.mse_loss,
    )


def test_leaves_with_disagreeing_batch_sizes():
    def collate(samples):
        batch = torch.utils.data.default_collate(samples)
        batch["y"] = batch["y"][:-1]
        return batch

    _refused(
        r"batch\['y'\] has 7 rows along dim 0 but batch\['x'\] has 8", training_step=nested_step, collate_fn=collate
    )


def test_an_iterable_shorter_than_one_global_batch():
    class Short(IterableDataset):
        def __iter__(self):
            yield from (NestedDataset()[i] for i in range(10))

    _refused("fewer samples than one global batch of 16", training_step=nested_step, data=Short())


def test_a_one_shot_iterator():
    _refused("one-shot iterator", training_step=nested_step, data=(NestedDataset()[i] for i in range(64)))


def test_both_or_neither_max_steps_and_max_epochs():
    for settings_ in ({}, {"max_steps": 3, "max_epochs": 1}):
        with pytest.raises(unison.ConfigurationError, match="set exactly one of max_steps and max_epochs"):
            unison.Trainer(**settings_)


def test_at_most_one_of_loss_fn_and_training_step():
    # Neither is the model's own loss, which needs dict batches with labels (these have none).
    _refused("neither loss_fn nor training_step was given.*'labels' tensor")
    _refused(
        "pass at most one of loss_fn and training_step", training_step=nested_step, loss_fn=torch.nn.functional.mse_loss
    )
    _refused(r"training_step\(model, batch\)", training_step=lambda batch: batch)


def test_a_factory_that_does_not_return_a_module():
    _refused("the model factory returned dict", training_step=nested_step, model=lambda: {})


def test_pipeline_refuses_the_training_step_form_naming_the_fix(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    trainer = unison.Trainer(strategy="pipeline", global_batch_size=16, accumulate_grad_batches=2, max_steps=2)
    with pytest.raises(unison.DeclaredRefusal, match=r"does not support the training_step.*Pass loss_fn") as info:
        trainer.fit(mlp(), NestedDataset(), training_step=nested_step, optimizer=_sgd)
    assert info.value.feature == "training_step" and not torch.distributed.is_initialized()


def test_streams_and_regression_data_agree_in_shape():
    # the shared fixtures the distributed tests use
    assert len(NestedDataset()) == 96 and sum(1 for _ in NestedStream()) == 96
    assert len(regression_data(n=64)) == 64
