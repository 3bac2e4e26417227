"""Run directories (metrics, run.json, TensorBoard events) in object storage, against a real S3 server.

The loggers write a local staging copy of ``version_N``; unison uploads
``run.json`` when the run opens, the rest every ``upload_every_s`` seconds
while metrics are logged and at the end of the fit. Refused credentials and
unknown schemes are errors naming ``logging.dir`` before training; a failed
final upload (the server gone) keeps the local copy and says where.
"""

from __future__ import annotations

import gc
import json
import shutil
import warnings
from pathlib import Path

import pytest
import s3_server

import unison
from unison.plugin import hookimpl
from unison.plugins.loggers import CSVLogger, JSONLLogger, RunDirectory, TensorBoardLogger, read_jsonl

from helpers import train
from s3_worlds import SMALL

pytestmark = pytest.mark.usefixtures("aws_env")  # conftest.py: the AWS variables point at the test server


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


class BucketReader:
    """Reads the run's metrics.jsonl from the bucket at the end of each step (what a dashboard would see)."""

    def __init__(self, s3, run: RunDirectory) -> None:
        self.s3, self.run = s3, run
        self.seen: dict[int, list[int]] = {}

    @hookimpl
    def unison_on_train_step_end(self, trainer, step, output) -> None:
        key = f"{s3_server.BUCKET}/{self.run.location.split('/', 3)[3]}/metrics.jsonl"
        fs = self.s3.fs()
        lines = fs.cat_file(key).decode().splitlines() if fs.exists(key) else []
        self.seen[step] = [json.loads(line)["step"] for line in lines if "train/loss" in line]


@pytest.mark.timeout(120)
def test_each_fit_uploads_a_new_version_with_every_loggers_files(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"s3://{s3_server.BUCKET}/runs/exp"
    loggers = [JSONLLogger(url), CSVLogger(url), TensorBoardLogger(url)]  # one shared RunDirectory
    run = loggers[0].run
    assert run is loggers[1].run is loggers[2].run and run.remote is not None
    first = train("single", max_steps=6, loggers=loggers, log_every_n_steps=1, **SMALL)
    assert run.location == f"{url}/version_0"
    keys = s3.objects("runs/exp")
    assert {"version_0/run.json", "version_0/metrics.jsonl", "version_0/metrics.csv"} <= set(keys), keys
    assert any(k.startswith("version_0/tensorboard/events.out.tfevents") for k in keys), keys
    # The bucket holds the local copy's final bytes, and they are the trainer's losses.
    fs = s3.fs()
    uploaded = fs.cat_file(f"{s3_server.BUCKET}/runs/exp/version_0/metrics.jsonl")
    assert uploaded == (run.path / "metrics.jsonl").read_bytes()
    (tmp_path / "m.jsonl").write_bytes(uploaded)
    assert losses(read_jsonl(tmp_path / "m.jsonl")) == {h["step"] + 1: h["loss"] for h in first["history"]}
    metadata = json.loads(fs.cat_file(f"{s3_server.BUCKET}/runs/exp/version_0/run.json"))
    assert metadata["run"] == "version_0" and metadata["strategy"]["name"] == "single"
    # The next fit is a new version; so is another process's run (numbered from the bucket's listing).
    train("single", max_steps=2, loggers=loggers, log_every_n_steps=1, **SMALL)
    other = RunDirectory(url)
    train("single", max_steps=2, loggers=[JSONLLogger(other)], log_every_n_steps=1, **SMALL)
    versions = sorted({k.split("/")[0] for k in s3.objects("runs/exp")})
    assert versions == ["version_0", "version_1", "version_2"], versions
    assert other.location == f"{url}/version_2"
    assert list(tmp_path.iterdir()) == [tmp_path / "m.jsonl"]  # nothing local named after the URL


@pytest.mark.timeout(120)
def test_metrics_reach_the_bucket_while_training(s3, tmp_path):
    url = f"s3://{s3_server.BUCKET}/runs/live"
    run = RunDirectory(url, upload_every_s=0)  # every logging step
    reader = BucketReader(s3, run)
    train("single", max_steps=5, loggers=[JSONLLogger(run), reader], log_every_n_steps=1, **SMALL)
    # Step k's metrics (logged as step k + 1, the count of optimizer steps) come after its step-end
    # hook: at that hook the bucket holds those of steps 0..k-1.
    assert reader.seen == {k: list(range(1, k + 1)) for k in range(5)}, reader.seen
    lazy = RunDirectory(f"s3://{s3_server.BUCKET}/runs/lazy", upload_every_s=3600)
    reader = BucketReader(s3, lazy)
    train("single", max_steps=3, loggers=[JSONLLogger(lazy), reader], log_every_n_steps=1, **SMALL)
    assert reader.seen == {0: [], 1: [], 2: []}  # only run.json until the end of the fit
    assert [r["step"] for r in read_jsonl(lazy.path / "metrics.jsonl")] == [1, 2, 3]
    assert set(s3.objects("runs/lazy")) == {"version_0/run.json", "version_0/metrics.jsonl"}


@pytest.mark.timeout(60)
def test_bad_run_directory_locations_fail_before_training(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(unison.ConfigurationError, match=r"logging.dir.*refused access"):
        JSONLLogger(f"s3://{s3_server.BUCKET}/runs/refused")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.SECRET)
    with pytest.raises(unison.ConfigurationError, match=r"logging.dir.*bucket 'no-such-bucket'"):
        CSVLogger("s3://no-such-bucket/runs")
    with pytest.raises(unison.ConfigurationError, match=r"logging.dir.*scheme 'gs'"):
        JSONLLogger("gs://bucket/runs")
    with pytest.raises(unison.ConfigurationError, match=r"logging.upload_every_s"):
        RunDirectory(f"s3://{s3_server.BUCKET}/runs/x", upload_every_s=-1)
    assert list(tmp_path.iterdir()) == []
    assert s3.objects("runs/refused") == []


@pytest.mark.timeout(180)
def test_a_failed_final_upload_keeps_the_local_copy(tmp_path, monkeypatch):
    """A second server, stopped during training: the fit ends normally and the metrics stay on disk."""
    server = s3_server.start()
    try:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        # The final upload retries a refused connection for this long, then keeps the local copy.
        monkeypatch.setenv("UNISON_STORAGE_RETRY_S", "3")
        run = RunDirectory(f"s3://{s3_server.BUCKET}/runs/gone", upload_every_s=3600)

        class StopServer:
            @hookimpl
            def unison_on_train_step_end(self, trainer, step, output) -> None:
                if step == 1:
                    server.stop()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = train(
                "single",
                max_steps=3,
                loggers=[JSONLLogger(run), StopServer()],
                log_every_n_steps=1,
                **SMALL,
            )
        assert [h["step"] for h in result["history"]] == [0, 1, 2]
        messages = [str(w.message) for w in caught]
        assert any("kept in" in m and str(run.path) in m for m in messages), messages
        kept = Path(run.path) / "metrics.jsonl"
        del run, result  # the staging directory outlives the RunDirectory object: it holds the only copy
        gc.collect()
        assert [r["step"] for r in read_jsonl(kept)] == [1, 2, 3]
        shutil.rmtree(kept.parents[2])
    finally:
        server.stop()
