"""Sharded data in object storage, against a real S3 server (SeaweedFS on loopback, started by conftest.py).

The same JSON-lines shards on local disk and in ``s3://``: training from the bucket under single, ddp and
fsdp, with 0 and 2 loader workers, ends at the weights of one process reading local disk; save -> resume
equals the uninterrupted run. Read amplification is the server's own counter of bytes sent over one pass,
against the dataset's bytes, for the sharded source and for today's iterable path. A changed object
(new ETag) is detected, a corrupt record is named, transient failures are retried and counted (in the
loader workers too, summed into the trainer's ``data/retries`` metric across a server restart), and
processes that start together build a missing index once.
"""

from __future__ import annotations

import json
import multiprocessing
import threading

import pytest
import s3_server
import torch
from shard_files import decode, samples, write_jsonl

import unison
from unison.data.shards import ShardedDataset, ShardError
from unison.launch.torchrun import spawn

from helpers import max_abs_diff, mlp
from shards_worlds import RESUME_AT, STEPS, fit, one_pass, runs

pytestmark = pytest.mark.usefixtures("aws_env", "index_cache")

TOL = 1e-6
PREFIX = "shards"


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    """96 samples in 3 JSON-lines shards on local disk."""
    return tmp_path_factory.mktemp("shards")


@pytest.fixture(scope="module")
def bucket(s3, shard_dir) -> dict[str, str]:
    """The shards on local disk and uploaded to the test bucket; their globs and URLs."""
    paths = write_jsonl(shard_dir / "train", samples(96), 3)
    fs = s3.fs()
    for path in paths:
        fs.put_file(str(path), f"{s3_server.BUCKET}/{PREFIX}/train/{path.name}")
    return {
        "local": str(shard_dir / "train" / "*.jsonl"),
        "s3": f"s3://{s3_server.BUCKET}/{PREFIX}/train/*.jsonl",
        "urls": [f"s3://{s3_server.BUCKET}/{PREFIX}/train/{p.name}" for p in paths],
    }


@pytest.fixture
def index_cache(tmp_path_factory, monkeypatch):
    """One index cache for the module's runs (spawned ranks inherit it)."""
    monkeypatch.setenv("UNISON_DATA_CACHE", str(tmp_path_factory.getbasetemp() / "shard-index"))


@pytest.fixture(scope="module")
def reference(bucket) -> dict:
    """One process, local disk, no workers: what every run from the bucket must equal."""
    return fit(ShardedDataset(bucket["local"], decode), "single", 0)


@pytest.mark.timeout(300)
def test_single_from_the_bucket_equals_local_disk_with_0_and_2_workers_and_resumes(bucket, reference):
    got = runs(["single"], bucket["s3"], (0, 2))
    assert reference["steps"] == list(range(STEPS))
    for w in (0, 2):
        assert max_abs_diff(got[f"single-{w}"]["state"], reference["state"]) == 0.0, w
        resumed = got[f"single-{w}-resumed"]
        assert resumed["steps"] == list(range(RESUME_AT, STEPS))
        assert max_abs_diff(resumed["state"], reference["state"]) == 0.0, w
        assert resumed["losses"] == reference["losses"][RESUME_AT:]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_ddp_and_fsdp_from_the_bucket_equal_single_on_local_disk(bucket, reference):
    ShardedDataset(bucket["s3"])  # the index, built once here; the ranks load it from the cache
    results = spawn(runs, 2, ["ddp", "fsdp"], bucket["s3"], (0, 2), timeout=560)
    for rank, got in enumerate(results):
        for strategy in ("ddp", "fsdp"):
            for w in (0, 2):
                key = f"{strategy}-{w}"
                assert got[key]["steps"] == list(range(STEPS)), key
                assert max_abs_diff(got[key]["state"], reference["state"]) <= TOL, (rank, key)
                assert got[key]["losses"] == pytest.approx(reference["losses"], rel=1e-5), key
                resumed = got[f"{key}-resumed"]
                assert resumed["steps"] == list(range(RESUME_AT, STEPS)), key
                assert max_abs_diff(resumed["state"], reference["state"]) <= TOL, (rank, key)


def _amplification(s3, bucket, kind: str, world: int) -> float:
    dataset = ShardedDataset(bucket["s3"])  # builds (or loads) the index before counting
    size = sum(s3.fs().info(url)["size"] for url in bucket["urls"])
    before = s3.sent_bytes()
    results = spawn(one_pass, world, kind, bucket["s3"], bucket["urls"], timeout=300)
    sent = s3.sent_bytes() - before
    assert results[0] == list(range(len(dataset) // 16)), results[0]  # one whole pass
    return sent / size


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_read_amplification_at_world_2_is_about_1_against_2_for_the_iterable_path(s3, bucket):
    sharded = _amplification(s3, bucket, "sharded", 2)
    iterable = _amplification(s3, bucket, "iterable", 2)
    # The sharded source: each sample once, plus the trainer's check of the first micro-batch.
    assert 0.95 <= sharded <= 1.2, sharded
    # Today's path: every rank reads every shard.
    assert iterable >= 1.95, iterable


@pytest.mark.full
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_read_amplification_at_world_4(s3, bucket):
    sharded = _amplification(s3, bucket, "sharded", 4)
    assert 0.95 <= sharded <= 1.2, sharded
    assert _amplification(s3, bucket, "iterable", 4) >= 3.9


@pytest.mark.full
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_ddp_at_world_4_from_the_bucket_equals_single_on_local_disk(bucket, reference):
    ShardedDataset(bucket["s3"])
    for rank, got in enumerate(spawn(runs, 4, ["ddp"], bucket["s3"], (0,), timeout=560)):
        assert max_abs_diff(got["ddp-0"]["state"], reference["state"]) <= TOL, rank
        assert max_abs_diff(got["ddp-0-resumed"]["state"], reference["state"]) <= TOL, rank


def test_a_changed_object_is_detected_by_its_etag(s3, bucket):
    fs = s3.fs()
    url = f"s3://{s3_server.BUCKET}/{PREFIX}/changed/part-000.jsonl"
    fs.pipe_file(url.removeprefix("s3://"), fs.cat_file(bucket["urls"][0].removeprefix("s3://")))
    old = ShardedDataset(url, decode)
    assert set(old.shards[0][1].version) == {"etag"}
    rows = samples(32, seed=99)  # the same size of file is likely; the ETag tells them apart anyway
    fs.pipe_file(url.removeprefix("s3://"), "".join(json.dumps(r) + "\n" for r in rows).encode())
    with pytest.raises(ShardError, match=r"changed/part-000\.jsonl changed since its index was built"):
        ShardedDataset(url, decode, on_change="error")
    with pytest.raises(ShardError, match=r"changed/part-000\.jsonl changed since its index was built .*refusing"):
        old[3]
    with pytest.warns(UserWarning, match="indexing it again"):
        fresh = ShardedDataset(url, decode)
    assert torch.equal(fresh[3][0], torch.tensor(rows[3]["x"]))


def test_a_corrupt_record_in_the_bucket_names_shard_and_position(s3, bucket):
    fs = s3.fs()
    key = f"{s3_server.BUCKET}/{PREFIX}/corrupt/part-000.jsonl"
    lines = fs.cat_file(bucket["urls"][1].removeprefix("s3://")).decode().splitlines()
    lines[4] = lines[4][: len(lines[4]) // 2]
    fs.pipe_file(key, ("\n".join(lines) + "\n").encode())
    dataset = ShardedDataset(f"s3://{key}", decode)
    with pytest.raises(ShardError, match=r"s3://.*corrupt/part-000\.jsonl, record 4 \(sample 4\) at byte \d+"):
        dataset.__getitems__([2, 3, 4])


def test_transient_failures_are_retried_with_bounded_backoff_and_counted(s3, bucket, monkeypatch):
    dataset = ShardedDataset(bucket["s3"], decode)
    dataset[0]
    # The endpoint stops answering (a port nothing listens on): every read fails with a connection error.
    # 5 s: a first try that takes a second or two on a loaded machine (a new client session) still leaves
    # room for retries (0.5, 1, 2 s apart).
    monkeypatch.setenv("UNISON_STORAGE_RETRY_S", "5")
    dataset.storage_options["endpoint_url"] = f"http://127.0.0.1:{s3_server._free_port()}"
    dataset._fs = None
    with pytest.raises(ShardError, match=r"part-000\.jsonl: failed to read after \d+ tries over \d+ s") as caught:
        dataset[1]
    assert "EndpointConnectionError" in str(caught.value)
    # Every try after the first is a counted retry.
    tries = int(str(caught.value).split("failed to read after ")[1].split()[0])
    assert tries >= 2 and dataset.stats.retries == tries - 1, (tries, dataset.stats)


class _Outage:
    """Kills the server before step ``step``'s optimizer step and starts it again ``seconds`` later;
    records every logged metric."""

    def __init__(self, server, step: int, seconds: float) -> None:
        self.server, self.step, self.seconds, self.metrics = server, step, seconds, []

    @unison.hookimpl
    def unison_on_before_optimizer_step(self, trainer, step, grad_norm) -> None:
        if step == self.step:
            self.server.down()
            threading.Timer(self.seconds, self.server.up).start()

    @unison.hookimpl
    def unison_log_metrics(self, metrics) -> None:
        self.metrics.append(metrics)


@pytest.mark.timeout(300)
def test_retries_in_loader_workers_are_summed_into_the_trainers_data_retries_metric(bucket, shard_dir, monkeypatch):
    server = s3_server.start()  # its own server: this test stops it
    try:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        for path in sorted((shard_dir / "train").glob("*.jsonl")):
            server.fs().put_file(str(path), f"{s3_server.BUCKET}/outage/{path.name}")
        # No read-ahead: the workers read each micro-batch when asked, so reads fall into the outage.
        dataset = ShardedDataset(f"s3://{s3_server.BUCKET}/outage/*.jsonl", decode, read_ahead=0)
        outage = _Outage(server, step=1, seconds=3.0)
        trainer = unison.Trainer(
            strategy="single",
            global_batch_size=8,
            max_steps=12,  # one pass of the 96 samples: nothing is read after the last step's batch
            num_workers=2,
            seed=3,
            callbacks=[outage],
            progress="off",
            throughput=False,
        )
        trainer.fit(mlp(), dataset, loss_fn=torch.nn.functional.mse_loss, optimizer=torch.optim.AdamW)
    finally:
        server.stop()
    counted = [m["data/retries"] for m in outage.metrics if "data/retries" in m]
    assert len(counted) == 12 and counted == sorted(counted), counted
    # The loader workers retried (the main process read only the trainer's first-batch check, before
    # the outage), and their retries reached the main process's counts and the logged metric.
    workers = int(dataset.stats._counts[1:, 2].sum())
    assert workers > 0 and counted[-1] == dataset.stats.retries == workers, (counted, dataset.stats)


def _build_index(pattern: str, start) -> None:
    start.wait()
    ShardedDataset(pattern)


@pytest.mark.timeout(300)
def test_processes_that_find_no_index_build_it_once(s3, tmp_path, monkeypatch):
    # Shards large enough (about 5 MB) that indexing takes longer than the processes take to start.
    fs = s3.fs()
    for path in write_jsonl(tmp_path / "big", samples(30000), 3):
        fs.put_file(str(path), f"{s3_server.BUCKET}/{PREFIX}/big/{path.name}")
    size = sum(info["size"] for info in fs.ls(f"{s3_server.BUCKET}/{PREFIX}/big", detail=True))
    monkeypatch.setenv("UNISON_DATA_CACHE", str(tmp_path / "empty-cache"))
    context = multiprocessing.get_context("fork")  # as the ranks of one node, started together
    start = context.Barrier(4)
    before = s3.sent_bytes()
    pattern = f"s3://{s3_server.BUCKET}/{PREFIX}/big/*.jsonl"
    processes = [context.Process(target=_build_index, args=(pattern, start)) for _ in range(4)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(120)
    assert [p.exitcode for p in processes] == [0, 0, 0, 0]
    # One process read the shards to index them; the three others waited and loaded its index.
    assert (s3.sent_bytes() - before) / size < 1.5, (s3.sent_bytes() - before) / size
