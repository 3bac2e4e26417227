"""Every logger, read back through its own reader, on single, ddp, fsdp and zero2.

One 2-rank gloo world runs the logged run and the early-stopped run under
ddp, fsdp and zero2 (tests/observability_worlds.py); ``single`` runs here. An
``mlflow server`` (sqlite backend, artifacts in a temporary directory) runs on
127.0.0.1 for the module and is stopped after it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from unison.launch.torchrun import spawn

from observability_worlds import (  # sets DS_ACCELERATOR=cpu first
    BACKENDS,
    as_float32,
    backend_world,
    csv_metrics,
    early_stopped_run,
    jsonl_metrics,
    logged_run,
    mlflow_metrics,
    mlflow_server,
    same,
    tensorboard_metrics,
    wandb_config,
    wandb_metrics,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

STRATEGIES = ["single", *BACKENDS]
#: The fp32 ceiling of README "Numerics": losses and norms agree across backends within float round-off.
FP32_REL = 1e-5
#: Measured, not compared: wall times and memory differ between runs.
#: Measured per run, not trained: wall times and throughput, and a checkpoint's save time and size on disk (each
#: backend writes its own files).
MEASURED = ("perf/", "checkpoint/")


@pytest.fixture(scope="module")
def server():
    with mlflow_server() as uri:
        yield uri


@pytest.fixture(scope="module")
def runs(server, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("backends")
    world = spawn(backend_world, 2, str(root), server, timeout=800)
    out = {s: world[0][s] for s in BACKENDS}
    out["single"] = logged_run("single", str(root / "single"), server)
    out["single"]["early"] = early_stopped_run("single")
    out["rank1"] = {s: world[1][s] for s in BACKENDS}
    return out


@pytest.fixture(scope="module")
def client(server):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=server)


def test_rank_zero_writes_and_other_ranks_write_nothing(runs):
    for strategy in BACKENDS:
        assert runs[strategy]["run_dir"] is not None
        assert runs["rank1"][strategy]["run_dir"] is None
        assert Path(runs[strategy]["run_dir"]).name == "version_0"
        assert not (Path(runs[strategy]["run_dir"]).parent / "version_1").exists()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_logger_reads_back_exactly_what_the_trainer_logged(runs, client, strategy):
    run = runs[strategy]
    logged = run["metrics"]  # every unison_log_metrics call on rank 0, merged per step
    directory = Path(run["run_dir"])
    assert sorted(logged) == list(range(2, 17, 2))
    assert {
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/skipped",
        "val/loss",
        "lr/group0",
        "perf/step_time",
        "perf/samples_per_s",
        "perf/tokens_per_s",
        "perf/peak_rss_mib",
    } <= set(logged[16])
    # What the trainer computed for each step is what reached the loggers.
    for h in run["history"]:
        if (h["step"] + 1) % 2 == 0:
            assert logged[h["step"] + 1]["train/loss"] == h["loss"]
    same(jsonl_metrics(directory), logged)
    same(csv_metrics(directory), logged)
    same(tensorboard_metrics(directory), as_float32(logged))
    same(wandb_metrics(directory), logged)
    same(mlflow_metrics(client, run["mlflow_run_id"]), logged)


def test_backends_log_the_same_metrics_at_the_same_steps(runs):
    ref = runs["single"]["metrics"]
    for strategy in BACKENDS:
        got = runs[strategy]["metrics"]
        assert sorted(got) == sorted(ref)
        for step in ref:
            assert sorted(got[step]) == sorted(ref[step]), (strategy, step)
            for key, value in ref[step].items():
                if key.startswith(MEASURED):
                    continue
                if key.startswith(("train/lr", "lr/", "train/skipped")):
                    assert got[step][key] == value, (strategy, step, key)  # schedules and flags: exact
                else:
                    assert got[step][key] == pytest.approx(value, rel=FP32_REL), (strategy, step, key)
        # tokens/s counts every rank's tokens: 16 samples x 8 tokens per step on every backend
        for step in got:
            perf = got[step]
            assert perf["perf/tokens_per_s"] == pytest.approx(perf["perf/samples_per_s"] * 8, rel=1e-9)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_run_metadata_is_recorded_once_at_start(runs, client, strategy):
    import json

    run = runs[strategy]
    directory = Path(run["run_dir"])
    meta = json.loads((directory / "run.json").read_text())
    assert meta["strategy"] == {"name": strategy, "ownership": run["ownership"]}
    assert meta["config"]["trainer"]["strategy"] == strategy and meta["config"]["trainer"]["max_steps"] == 16
    assert meta["world_size"] == (1 if strategy == "single" else 2)
    assert {"python", "torch", "unison"} <= set(meta["versions"])
    # the same metadata as the W&B run's config, and as MLflow parameters, tags and artifact
    config = wandb_config(directory)
    assert config["strategy"]["ownership"] == run["ownership"] and config["versions"] == meta["versions"]
    mlflow_run = client.get_run(run["mlflow_run_id"])
    assert mlflow_run.data.params["trainer.strategy"] == strategy
    assert mlflow_run.data.params["trainer.max_steps"] == "16"
    assert mlflow_run.data.tags["unison.contract.strategy"] == strategy
    assert mlflow_run.data.tags["unison.version.torch"] == meta["versions"]["torch"]
    assert mlflow_run.info.status == "FINISHED"
    artifact = client.download_artifacts(run["mlflow_run_id"], "unison/run.json")
    assert json.loads(Path(artifact).read_text())["strategy"]["ownership"] == run["ownership"]


def test_early_stopping_stops_at_the_same_step_on_every_backend(runs):
    ref = runs["single"]["early"]
    assert ref["stopped_step"] == ref["global_step"] < 40  # it stopped, before max_steps
    for strategy in BACKENDS:
        for result in (runs[strategy]["early"], runs["rank1"][strategy]["early"]):
            assert result["stopped_step"] == ref["stopped_step"] and result["global_step"] == ref["global_step"]
            assert sorted(result["val"]) == sorted(ref["val"])


def test_model_checkpoint_keeps_the_best_two_by_val_loss_and_the_newest_on_every_backend(runs):
    for strategy in STRATEGIES:
        run = runs[strategy]
        val = {step: m["val/loss"] for step, m in run["metrics"].items() if "val/loss" in m}
        assert run["scores"] == val  # every validation scored its checkpoint
        best = sorted(val, key=val.get)[:2]
        newest = max(val)
        assert newest not in best  # the validation loss rises after its minimum
        kept = sorted(p.name for p in Path(run["ckpt_root"]).glob("step-*"))
        assert kept == [f"step-{s:08d}" for s in sorted({*best, newest})], strategy
        assert (Path(run["ckpt_root"]) / "latest").read_text().strip() == f"step-{newest:08d}"
