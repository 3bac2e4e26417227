"""The sharded source on local disk, in one process: formats, the index cache, failures, reads, order."""

from __future__ import annotations

import gzip
import json
import os
import re

import pytest
import torch
from shard_files import decode, decode_tar, samples, write_jsonl, write_parquet, write_tar
from torch.utils.data import DataLoader, TensorDataset, default_collate

import unison
from unison.data.plan import BatchPlan
from unison.data.read_ahead import WASTE, coalesce
from unison.data.shards import ShardedDataset, ShardError
from unison.data.streams import MicroBatchSampler

from helpers import max_abs_diff, mlp

ROWS = samples(96)


@pytest.fixture(autouse=True)
def index_cache(tmp_path, monkeypatch):
    """A private index cache per test (the default is under the home directory)."""
    monkeypatch.setenv("UNISON_DATA_CACHE", str(tmp_path / "index-cache"))
    return tmp_path / "index-cache"


def _as_lists(dataset) -> list:
    return [[t.tolist() for t in dataset[i]] for i in range(len(dataset))]


def test_every_format_gives_the_same_samples_in_order(tmp_path):
    expected = [[r["x"], r["y"]] for r in ROWS]
    write_jsonl(tmp_path / "j", ROWS, 3)
    with gzip.open(tmp_path / "g.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n\n" for r in ROWS)  # blank lines are not records
    write_tar(tmp_path / "w.tar", ROWS)
    write_parquet(tmp_path / "t.parquet", ROWS, row_group_size=10)
    for dataset in (
        ShardedDataset(str(tmp_path / "j" / "part-*.jsonl"), decode),
        ShardedDataset(str(tmp_path / "g.jsonl.gz"), decode),
        ShardedDataset(str(tmp_path / "w.tar"), decode_tar),
        ShardedDataset(str(tmp_path / "t.parquet"), decode),
    ):
        assert len(dataset) == 96
        got = _as_lists(dataset)
        assert [[torch.tensor(x).tolist(), torch.tensor(y).tolist()] for x, y in expected] == got
    # Global sample i -> (shard, position): 96 rows over 3 shards of 32.
    dataset = ShardedDataset([str(tmp_path / "j" / "part-*.jsonl")], decode)
    assert dataset.locate(0) == (0, 0) and dataset.locate(33) == (1, 1) and dataset.locate(95) == (2, 31)
    with pytest.raises(IndexError):
        dataset.locate(96)
    tar = ShardedDataset(str(tmp_path / "w.tar"))
    assert tar[5]["cls"] == b"5" and set(tar[5]) == {"json", "cls"}


def test_the_index_is_built_once_and_cached_by_version(tmp_path, index_cache):
    write_jsonl(tmp_path / "d", ROWS, 2)
    ShardedDataset(str(tmp_path / "d" / "*.jsonl"))
    files = sorted(index_cache.glob("*.json"))  # beside them, the lock files of the builds
    assert len(files) == 2
    entry = json.loads(files[0].read_text())
    assert entry["format"] == "jsonl" and entry["count"] == 48 and set(entry["version"]) == {"mtime", "size"}
    before = [f.stat().st_mtime_ns for f in files]
    ShardedDataset(str(tmp_path / "d" / "*.jsonl"))
    assert [f.stat().st_mtime_ns for f in sorted(index_cache.glob("*.json"))] == before  # loaded, not rebuilt


def test_a_changed_shard_is_reindexed_or_refused_never_mixed(tmp_path):
    paths = write_jsonl(tmp_path / "d", ROWS, 2)
    pattern = str(tmp_path / "d" / "*.jsonl")
    old = ShardedDataset(pattern, decode)
    old[0]
    paths[1].write_text("".join(json.dumps(r) + "\n" for r in ROWS[:10]))  # 10 samples instead of 48
    with pytest.raises(ShardError, match=r"part-001\.jsonl changed since its index was built"):
        ShardedDataset(pattern, decode, on_change="error")
    with pytest.warns(UserWarning, match=r"part-001\.jsonl changed since its index was built: indexing it again"):
        fresh = ShardedDataset(pattern, decode)
    assert len(fresh) == 58
    # The dataset built before the change refuses to read the new bytes with the old offsets.
    with pytest.raises(ShardError, match=r"part-001\.jsonl changed since its index was built .*refusing to mix"):
        old[50]
    # A loader worker is a new process: it checks each shard's version on first read too.
    old._verified.discard(0)
    paths[0].write_text(paths[0].read_text() + json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ShardError, match=r"part-000\.jsonl changed"):
        old[1]


def test_a_corrupt_record_names_the_shard_and_position(tmp_path):
    paths = write_jsonl(tmp_path / "d", ROWS, 2)
    lines = paths[1].read_text().splitlines()
    lines[7] = '{"x": [1.0, 2.0'  # truncated JSON
    paths[1].write_text("\n".join(lines) + "\n")
    dataset = ShardedDataset(str(tmp_path / "d" / "*.jsonl"), decode)
    dataset[54]  # its neighbour reads fine
    with pytest.raises(ShardError, match=r"part-001\.jsonl, record 7 \(sample 55\) at byte \d+ is not valid JSON"):
        dataset[55]
    with pytest.raises(ShardError, match=r"part-001\.jsonl, record 7 \(sample 55\)"):
        dataset.__getitems__([1, 55, 60])
    # A decode function that fails is named with the sample too.
    bad = ShardedDataset(str(tmp_path / "d" / "part-000.jsonl"), lambda s: s["z"])
    with pytest.raises(ShardError, match=r"part-000\.jsonl, record 3 \(sample 3\): decode failed: KeyError"):
        bad[3]
    (tmp_path / "bad.tar").write_bytes(b"not a tar file" * 100)
    with pytest.raises(ShardError, match=r"bad\.tar: not a readable tar file"):
        ShardedDataset(str(tmp_path / "bad.tar"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 nope")
    with pytest.raises(ShardError, match=r"bad\.parquet: not a readable Parquet file"):
        ShardedDataset(str(tmp_path / "bad.parquet"))


def test_missing_shards_are_named(tmp_path):
    paths = write_jsonl(tmp_path / "d", ROWS, 2)
    with pytest.raises(ShardError, match=r"nothing-\*\.jsonl: no shard matches"):
        ShardedDataset(str(tmp_path / "d" / "nothing-*.jsonl"))
    with pytest.raises(ShardError, match=r"part-009\.jsonl: shard not found"):
        ShardedDataset([str(paths[0]), str(tmp_path / "d" / "part-009.jsonl")])
    dataset = ShardedDataset(str(tmp_path / "d" / "*.jsonl"))
    os.remove(paths[1])
    dataset._verified.clear()  # as in a loader worker, which checks each shard on first read
    with pytest.raises(ShardError, match=r"part-001\.jsonl: shard not found \(it was indexed, then removed\)"):
        dataset[60]
    with pytest.raises(ShardError, match="unknown shard format"):
        (tmp_path / "x.csv").write_text("a,b\n")
        ShardedDataset(str(tmp_path / "x.csv"))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_together_read_each_record_once_per_pass(tmp_path, world):
    write_jsonl(tmp_path / "d", ROWS, 3)
    pattern = str(tmp_path / "d" / "*.jsonl")
    total = 0
    for rank in range(world):
        dataset = ShardedDataset(pattern, decode)
        plan = BatchPlan(len(dataset), 16, 2, world, rank, seed=0)
        for step in range(plan.steps_per_epoch):
            for indices in plan.local_micro_indices(step):
                dataset.__getitems__(indices)
        total += dataset.stats.bytes
    # Coalesced ranges: the record bytes, plus at most 10 % read between two merged neighbours.
    records = sum(e - s for _, index in ShardedDataset(pattern).shards for s, e in zip(index.starts, index.ends))
    assert records <= total <= records * (1 + WASTE) + len(ROWS)


def test_coalesce_joins_the_cheapest_gaps_within_the_waste_budget():
    # Three 100-byte records of file "a" with gaps of 1, 50 and 5 bytes, one of "b".
    records = [(0, "a", 0, 100), (1, "a", 101, 201), (2, "a", 251, 351), (3, "a", 356, 456), (4, "b", 0, 100)]
    spans = coalesce(records, waste=0.02)  # 10 bytes of budget: the 1- and 5-byte gaps, not the 50-byte one
    assert [(f, lo, hi) for f, lo, hi, _ in spans] == [("a", 0, 201), ("a", 251, 456), ("b", 0, 100)]
    assert [[r[0] for r in members] for *_, members in spans] == [[0, 1], [2, 3], [4]]
    # A gap holding a record wanted soon costs only the rest of it: read along and returned.
    spans = coalesce(records, [(9, "a", 201, 251)], waste=0.02)
    assert [(f, lo, hi) for f, lo, hi, _ in spans] == [("a", 0, 456), ("b", 0, 100)]
    assert [r[0] for r in spans[0][3]] == [0, 1, 9, 2, 3]
    assert len(coalesce(records, waste=0.0)) == 5  # nothing to spare: one request per record


@pytest.mark.parametrize("workers", [0, 2])
def test_read_ahead_along_the_plan_gives_the_same_samples_in_fewer_requests(tmp_path, workers):
    write_jsonl(tmp_path / "d", samples(512), 4)
    pattern = str(tmp_path / "d" / "*.jsonl")
    got, requests = {}, {}
    for read_ahead in (0, 1 << 20):
        dataset = ShardedDataset(pattern, decode, shuffle_window=128, read_ahead=read_ahead)
        plan = BatchPlan(len(dataset), 32, 2, 1, 0, seed=0, order=dataset.epoch_order)
        sampler = MicroBatchSampler(plan, 0, 2 * plan.steps_per_epoch)  # two epochs
        dataset.follow_plan(sampler)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=default_collate, num_workers=workers)
        got[read_ahead] = [x for x, _ in loader]
        requests[read_ahead] = dataset.stats.requests  # the workers' reads included
    assert len(got[0]) == 64 and all(torch.equal(a, b) for a, b in zip(got[0], got[1 << 20]))
    # Without read-ahead about one request per sample (neighbours rarely meet in a micro-batch); with it,
    # each worker reads stretches of its windows.
    assert requests[0] > 700, requests
    assert requests[1 << 20] * 4 < requests[0], requests


def test_the_window_shuffle_is_a_seeded_permutation_of_shards_then_windows(tmp_path):
    write_jsonl(tmp_path / "d", ROWS, 4)  # 4 shards of 24
    dataset = ShardedDataset(str(tmp_path / "d" / "*.jsonl"), shuffle_window=8)
    order = dataset.epoch_order(0, 0)
    assert sorted(order.tolist()) == list(range(96))
    assert not torch.equal(order, dataset.epoch_order(0, 1)) and torch.equal(order, dataset.epoch_order(0, 0))
    # Each window of 8 holds samples of one shard (shards of 24 are 3 whole windows) and is permuted.
    for w in range(12):
        window = order[w * 8 : (w + 1) * 8]
        assert len({int(i) // 24 for i in window}) == 1
    assert order.tolist() != sorted(order.tolist())
    assert ShardedDataset(str(tmp_path / "d" / "*.jsonl")).epoch_order(0, 0) is None  # the trainer's permutation
    # Runs of 4 consecutive samples stay together; the runs are permuted within the windows.
    chunked = ShardedDataset(str(tmp_path / "d" / "*.jsonl"), shuffle_window=24, shuffle_chunk=4).epoch_order(0, 0)
    assert sorted(chunked.tolist()) == list(range(96))
    runs = chunked.view(-1, 4)
    assert all(r.tolist() == list(range(int(r[0]), int(r[0]) + 4)) for r in runs)
    assert runs[:, 0].tolist() != sorted(runs[:, 0].tolist())


def _fit(data, workers: int, **settings):
    trainer = unison.Trainer(
        strategy="single",
        global_batch_size=16,
        accumulate_grad_batches=2,
        num_workers=workers,
        seed=5,
        progress="off",
        throughput=False,
        **({"max_epochs": 2} | settings),
    )
    progress = trainer.fit(mlp(), data, loss_fn=torch.nn.functional.mse_loss, optimizer=torch.optim.AdamW)
    return trainer.full_state_dict(), [h.loss for h in progress.history]


def test_trains_exactly_as_the_same_samples_in_memory_with_0_and_2_workers(tmp_path):
    write_jsonl(tmp_path / "d", ROWS, 3)
    tensors = TensorDataset(torch.tensor([r["x"] for r in ROWS]), torch.tensor([r["y"] for r in ROWS]))
    reference, losses = _fit(tensors, 0)
    for workers in (0, 2):
        state, got = _fit(ShardedDataset(str(tmp_path / "d" / "*.jsonl"), decode), workers)
        assert max_abs_diff(state, reference) == 0.0 and got == losses, workers
    windowed = [_fit(ShardedDataset(str(tmp_path / "d" / "*.jsonl"), decode, shuffle_window=16), w) for w in (0, 2)]
    assert max_abs_diff(windowed[0][0], windowed[1][0]) == 0.0 and windowed[0][1] == windowed[1][1]
    assert windowed[0][1] != losses  # another order than the global permutation


def test_resume_reads_only_the_steps_left(tmp_path):
    write_jsonl(tmp_path / "d", ROWS, 3)
    pattern = str(tmp_path / "d" / "*.jsonl")
    full = ShardedDataset(pattern, decode)
    state, losses = _fit(full, 0, max_epochs=None, max_steps=6)
    ckpt = {"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every_n_steps": 4}
    _fit(ShardedDataset(pattern, decode), 0, max_epochs=None, max_steps=4, **ckpt)
    resumed = ShardedDataset(pattern, decode)
    trainer = unison.Trainer(
        strategy="single", global_batch_size=16, accumulate_grad_batches=2, seed=5, max_steps=6, **ckpt
    )
    progress = trainer.fit(
        mlp(), resumed, loss_fn=torch.nn.functional.mse_loss, optimizer=torch.optim.AdamW, ckpt_path="last"
    )
    assert max_abs_diff(trainer.full_state_dict(), state) == 0.0
    assert [h.loss for h in progress.history] == losses[4:]
    # Steps 4 and 5 only: 2 of 6 steps' samples (the trainer's first-batch check reads step 4's once more).
    per_step = full.stats.bytes / 6
    assert resumed.stats.bytes <= 3 * per_step, (resumed.stats.bytes, full.stats.bytes)


def test_a_config_names_sharded_files_and_a_decode_function(tmp_path, capsys, monkeypatch):
    from unison.cli import main
    from unison.config.load import ConfigErrors, load_config, resolve_run

    write_jsonl(tmp_path / "train", ROWS, 3)
    write_jsonl(tmp_path / "val", ROWS[:40], 1)
    (tmp_path / "factories.py").write_text(
        "import torch\n\n"
        "def model():\n    return torch.nn.Linear(8, 1)\n\n"
        "def decode(sample):\n    return torch.tensor(sample['x']), torch.tensor(sample['y'])\n\n"
        "def loss(out, target):\n    return torch.nn.functional.mse_loss(out, target)\n"
    )
    config = tmp_path / "run.toml"
    body = (
        '[model]\nfactory = "factories.py:model"\n[loss]\nfactory = "factories.py:loss"\n'
        '[data]\ntrain = "train/*.jsonl"\nval = ["val/part-000.jsonl"]\ndecode = "factories.py:decode"\n'
        "shuffle_window = 32\n"
    )
    config.write_text('[trainer]\nmax_steps = 3\nglobal_batch_size = 16\nprogress = "off"\n' + body)
    monkeypatch.chdir(tmp_path)  # relative shard paths are the working directory's, like checkpoint_dir
    loaded, base = load_config(config)
    train, val = resolve_run(loaded, base)["data"]()
    assert isinstance(train, ShardedDataset) and len(train) == 96 and len(val) == 40
    assert train.shuffle_window == 32 and torch.equal(train[0][0], torch.tensor(ROWS[0]["x"]))
    main(["train", str(config)])
    assert "final validation loss" in capsys.readouterr().out
    # Each problem named: both sources, a decode outside the trust roots, kwargs without a factory.
    config.write_text(
        body.replace("[data]\n", '[data]\nfactory = "factories.py:model"\n').replace(
            '"factories.py:decode"', '"os:system"'
        )
    )
    with pytest.raises(ConfigErrors) as caught:
        load_config(config)
    text = str(caught.value)
    assert "give exactly one of factory and train" in text and "[trainer] section" in text
    config.write_text(body.replace('"factories.py:decode"', '"os:system"'))
    with pytest.raises(ConfigErrors, match=r"data\.decode"):
        load_config(config, {"max_steps": 1, "global_batch_size": 16})


class _Rewrite:
    """After step 5, rewrites every shard in place: the same byte layout (and mtime), new content."""

    def __init__(self, paths) -> None:
        self.paths = paths

    @unison.hookimpl
    def unison_on_train_step_end(self, step):
        if step == 5:
            for path in self.paths:
                stat = os.stat(path)
                path.write_text(path.read_text().translate(str.maketrans("17", "71")))
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("read_ahead", [0, 4096, 32 << 20])
def test_shards_rewritten_during_a_run_are_refused_never_mixed(tmp_path, read_ahead):
    """Every shard rewritten after step 5 with the same byte layout, size and mtime, new content: at read-ahead
    0 and 4096 bytes the run stops at the first record of the new version, naming its shard; at the default
    (32 MiB, which holds this whole plan) it may also end on the version read ahead. Never both versions."""
    paths = write_jsonl(tmp_path / "d", ROWS, 3)
    before = {tuple(r["x"]) for r in ROWS}
    seen: list[tuple] = []

    def recording(sample):
        seen.append(tuple(sample["x"]))
        return decode(sample)

    data = ShardedDataset(str(tmp_path / "d" / "*.jsonl"), recording, read_ahead=read_ahead)
    trainer = unison.Trainer(
        strategy="single",
        global_batch_size=16,
        max_epochs=3,
        seed=5,
        progress="off",
        throughput=False,
        loggers=False,
        callbacks=[_Rewrite(paths)],
    )
    try:
        trainer.fit(mlp(), data, loss_fn=torch.nn.functional.mse_loss, optimizer=torch.optim.AdamW)
        refused = None
    except ShardError as exc:
        refused = str(exc)
    if read_ahead <= 4096:
        assert refused is not None, "a rewritten shard was read without an error"
    if refused is not None:
        assert re.match(r".*part-00[0-2]\.jsonl changed while this run read it: record \d+ ", refused), refused
        assert "refusing to mix samples of two versions" in refused
        assert trainer.progress.global_step > 5
    assert len(seen) > 5 * 16 and all(x in before for x in seen), "a sample of the rewritten shards was used"
