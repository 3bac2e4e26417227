"""Operations: structured (JSON) logs, stragglers named, OpenTelemetry export, on one real 2-rank job.

The job (``tests/ops_worlds.py`` under ``unison run --nproc 2 --log-format json``: ddp on 2 gloo ranks,
6 steps of 2 micro-batches, logging every 2 steps) sleeps 0.2 s inside every step on rank 1 and exports
its metrics over OTLP/HTTP to an in-process receiver (``tests/otlp_receiver.py``: a ``http.server`` on
127.0.0.1 decoding the protobuf requests with ``opentelemetry-proto``; no collector is packaged here).
One run serves the three checks; a second, failing one checks the one error report per job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from otlp_receiver import OTLPReceiver

import unison
from unison.errors import ConfigurationError
from unison.launch import messages

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "ops_worlds.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop(messages.FORMAT_ENV, None)
FIELDS = {"time", "level", "rank", "node", "step", "run_id", "message"}


def unison_run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "unison.cli", "run", "--log-format", "json", "--nproc", "2", SCRIPT, *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def records(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a JSON object (a line that is not one fails the test, naming it)."""
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"a line of the job's output is not JSON: {line!r}")
        assert isinstance(record, dict) and record.keys() >= FIELDS, line
        out.append(record)
    return out


@pytest.fixture(scope="module")
def slow_job():
    with OTLPReceiver() as receiver:
        proc = unison_run("--slow", "1:0.2", "--steps", "6", "--otlp", receiver.endpoint)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, receiver


@pytest.mark.distributed
def test_every_line_of_a_two_rank_run_is_one_json_object_with_rank_step_and_run_id(slow_job):
    proc, _ = slow_job
    out, err = records(proc.stdout), records(proc.stderr)
    every = out + err
    assert len({r["run_id"] for r in every}) == 1, "one run id for the launcher and both ranks"
    assert {r["node"] for r in every} == {messages.node()}
    progress = [r for r in out if r["message"].startswith("train step ")]
    assert [r["step"] for r in progress] == [2, 4, 6] and all(r["rank"] == 0 for r in progress)
    assert any(r["message"].startswith("setting up the process group") and r["rank"] == 0 for r in err)
    # Python warnings become records too, with the rank that raised them.
    warned = [r for r in err if r["level"] == "warning" and "sleeps 0.2 s per step" in r["message"]]
    assert [r["rank"] for r in warned] == [1], err


@pytest.mark.distributed
def test_the_rank_slowed_by_a_sleep_is_named_the_straggler(slow_job):
    proc, receiver = slow_job
    named = [r for r in records(proc.stdout) if r["message"].startswith("straggler at step")]
    assert named, proc.stdout
    for r in named:
        assert r["message"].startswith(f"straggler at step {r['step']}: rank 1 (")
        assert r["level"] == "warning" and r["rank"] == 0
    # In the metrics of both ranks: rank 1 is the slowest, rank 0 spends the sleep waiting for it.
    ranks = receiver.by_rank()
    for rank in ("0", "1"):
        metrics = ranks[rank]["metrics"]
        assert metrics["unison.stragglers.slowest_rank"][2] == 1
        assert metrics["unison.stragglers.flagged"][2] == 1
        assert metrics["unison.step.duration.max"][2] >= 0.2
    assert ranks["0"]["metrics"]["unison.wait.duration"][2] > 0.15  # far above the 0.2 s sleep's noise
    assert ranks["1"]["metrics"]["unison.wait.duration"][2] < 0.1
    assert ranks["1"]["metrics"]["unison.compute.duration"][2] > 0.15


@pytest.mark.distributed
def test_otlp_export_has_the_instruments_and_the_resource_attributes_of_each_rank(slow_job):
    proc, receiver = slow_job
    ranks = receiver.by_rank()
    assert set(ranks) == {"0", "1"}
    run_ids = set()
    for rank, entry in ranks.items():
        resource = entry["resource"]
        assert resource["service.name"] == "unison" and resource["unison.strategy"] == "ddp"
        assert resource["unison.node"] == resource["host.name"] == messages.node()
        assert resource["service.instance.id"] == f"{resource['unison.run_id']}/{rank}"
        run_ids.add(resource["unison.run_id"])
        metrics = entry["metrics"]
        assert metrics["unison.step"][1:] == ("gauge", 6)
        assert metrics["unison.train.loss"][1] == "gauge" and metrics["unison.train.loss"][2] > 0
        assert metrics["unison.step.duration"][0] == "s" and metrics["unison.step.duration"][2] > 0
        assert metrics["unison.memory.peak_rss"][0] == "By" and metrics["unison.memory.peak_rss"][2] > 2**20
        assert metrics["unison.skipped_steps"][1] == "sum"  # a counter
        for name in ("unison.learning_rate", "unison.grad_norm", "unison.samples.rate", "unison.restarts"):
            assert name in metrics, sorted(metrics)
    assert len(run_ids) == 1
    # The replica-averaged loss is the same on both ranks; each rank's own step time is its own.
    assert ranks["0"]["metrics"]["unison.train.loss"][2] == ranks["1"]["metrics"]["unison.train.loss"][2]
    shown = [r["message"] for r in records(proc.stderr) + records(proc.stdout)]
    assert not any("Exception while exporting" in m for m in shown), shown


@pytest.mark.distributed
def test_a_failing_two_rank_job_prints_one_error_record(tmp_path):
    proc = unison_run("--steps", "0", timeout=180)  # max_steps=0: a ConfigurationError on both ranks
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [r for r in records(proc.stdout) + records(proc.stderr) if r["level"] == "error"]
    assert len(errors) == 1, errors
    assert "max_steps" in errors[0]["message"] and errors[0]["rank"] is None  # the launcher's one report


def test_a_log_format_that_is_not_text_or_json_is_refused_naming_the_option():
    with pytest.raises(ConfigurationError, match="log_format"):
        unison.Trainer(max_steps=1, log_format="xml")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="log_format"):
        messages.configure("yaml")


def test_a_message_in_the_json_format_is_one_object_with_every_field(capsys, monkeypatch):
    monkeypatch.setenv(messages.FORMAT_ENV, "json")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(messages.RUN_ID_ENV, "job-7")
    messages.say("unison: hello\nworld", level="warning", step=12)
    monkeypatch.setenv(messages.FORMAT_ENV, "text")
    messages.say("unison: as text")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1] == "unison: as text"
    record = json.loads(lines[0])
    assert record.keys() == FIELDS
    assert record["message"] == "hello\nworld" and record["level"] == "warning"
    assert (record["rank"], record["step"], record["run_id"]) == (3, 12, "job-7")
    assert record["time"].endswith("Z")


def test_unison_train_with_a_bad_config_prints_json_records_and_one_error():
    cmd = [sys.executable, "-m", "unison.cli", "train", "examples/tinylm.toml", "--log-format", "json"]
    proc = subprocess.run(
        [*cmd, "--set", "trainer.max_steps=0"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    out, err = records(proc.stdout), records(proc.stderr)
    assert [r["message"] for r in out] == ["unison train examples/tinylm.toml: loading torch, checking the config"]
    assert [r["level"] for r in err] == ["error"] and "trainer.max_steps" in err[0]["message"]


def straggler_world() -> dict[str, Any]:
    """A 2-rank ddp fit with StragglerReport, host reads counted per step (tests/test_host_syncs.py's counter)."""
    import torch
    from test_host_syncs import SyncCounter

    from unison.plugins.callbacks import StragglerReport

    from helpers import mlp, regression_data

    counter, report = SyncCounter(), StragglerReport()
    trainer = unison.Trainer(
        strategy="ddp",
        max_steps=6,
        global_batch_size=16,
        log_every_n_steps=3,
        progress="off",
        loggers=False,
        throughput=False,
        callbacks=[counter, report],
    )
    with counter:
        trainer.fit(
            mlp(),
            regression_data(n=256),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        )
    return {"reads": [dict(counter.device_reads(s)) for s in range(6)], "last": report.last}


@pytest.mark.distributed
def test_the_straggler_exchange_runs_on_logging_steps_only_and_reads_nothing_between_them():
    from unison.launch.torchrun import spawn

    for rank in spawn(straggler_world, 2, timeout=300):
        reads = rank["reads"]
        for step in (0, 1, 3, 4):  # steps 2 and 5 log (log_every_n_steps=3)
            assert reads[step] == {}, (step, reads[step])
        assert any(site.startswith("stragglers.py") for site in reads[2]), reads[2]  # the exchange's values
        assert rank["last"]["step"] == 6 and len(rank["last"]["step_time"]) == 2
