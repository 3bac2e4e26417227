"""Checkpoints in object storage, against a real S3 server (SeaweedFS on loopback, started by conftest.py).

Save, automatic resume, verification, export and retention through
``checkpoint_dir="s3://..."`` for single, ddp, fsdp and zero2 end bitwise equal
to an uninterrupted local run; a kill mid-commit leaves the previous
checkpoint valid; refused credentials, a missing bucket, an unknown scheme
and a missing s3fs are clear errors before training. ``unison train`` on two nodes against the same
server is in tests/test_multinode_s3.py (long tier).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import s3_server
import torch

import unison
from unison.cli import main
from unison.launch.torchrun import spawn

from helpers import max_abs_diff, train
from s3_worlds import SMALL, save_resume

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


pytestmark = pytest.mark.usefixtures("aws_env")  # conftest.py: the AWS variables point at the test server


def objects(s3, prefix: str) -> list[str]:
    return s3.objects(prefix)


def committed_steps(keys: list[str]) -> list[str]:
    """Checkpoints a reader would find: ``step-*`` prefixes holding a manifest (not the temporary ``.partial``)."""
    return sorted({k.split("/")[0] for k in keys if k.startswith("step-") and k.endswith("/manifest.json")})


def check_cli(url: str, state: dict[str, torch.Tensor], tmp_path: Path, capsys) -> None:
    """verify and export, through the CLI, against the bucket."""
    main(["checkpoint", "verify", url])
    out = capsys.readouterr().out
    assert out.count("ok") == 2 and "FAIL" not in out, out
    main(["checkpoint", "inspect", url])
    assert "(latest)" in capsys.readouterr().out
    from safetensors.torch import load_file

    main(["checkpoint", "export", url, str(tmp_path / "w.safetensors")])
    exported = load_file(str(tmp_path / "w.safetensors"))
    assert max_abs_diff(exported, state) == 0.0


@pytest.mark.timeout(120)
def test_single_saves_resumes_verifies_exports_and_prunes_in_the_bucket(s3, tmp_path, capsys):
    url = f"s3://{s3_server.BUCKET}/single"
    full = train("single", max_steps=8, **SMALL)
    ckpt = {"checkpoint_dir": url, "checkpoint_every_n_steps": 2, "keep_last_n_checkpoints": 2, "ckpt_path": "auto"}
    first = train("single", max_steps=4, **ckpt, **SMALL)
    assert [h["step"] for h in first["history"]] == [0, 1, 2, 3]  # auto with an empty prefix: a fresh start
    resumed = train("single", max_steps=8, **ckpt, **SMALL)
    assert [h["step"] for h in resumed["history"]] == [4, 5, 6, 7]
    assert all(torch.equal(resumed["state"][k], full["state"][k]) for k in full["state"])
    keys = objects(s3, "single")
    # Retention (keep 2) in the bucket, `latest` names the newest, no temporary prefix is left.
    assert committed_steps(keys) == ["step-00000006", "step-00000008"], keys
    assert s3.fs().cat_file(f"{s3_server.BUCKET}/single/latest").decode().strip() == "step-00000008"
    assert not [k for k in keys if ".partial" in k or ".unison-probe" in k], keys
    assert {"step-00000008/state/.metadata", "step-00000008/trainer.pt", "step-00000008/rng/rank-00000.pt"} <= set(keys)
    assert not Path("s3:").exists()  # never a local directory named after the URL
    check_cli(url, resumed["state"], tmp_path, capsys)


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_ddp_fsdp_zero2_save_and_resume_through_the_bucket_bitwise(s3, tmp_path, capsys):
    strategies = ["ddp", "fsdp", "zero2"]
    url = f"s3://{s3_server.BUCKET}/world"
    results = spawn(save_resume, 2, strategies, url, timeout=400)
    for strategy in strategies:
        for rank, r in enumerate(results):
            got = r[strategy]
            assert got["first_steps"] == [0, 1, 2, 3] and got["resumed_steps"] == [4, 5, 6, 7], (strategy, got)
            assert got["equal"] and got["diff"] == 0.0, (strategy, rank, got["diff"])
        keys = objects(s3, f"world/{strategy}")
        assert committed_steps(keys) == ["step-00000006", "step-00000008"], (strategy, keys)
        # Both ranks' files reached the bucket: each rank uploads what it wrote.
        assert "step-00000008/rng/rank-00000.pt" in keys and "step-00000008/rng/rank-00001.pt" in keys
        check_cli(f"{url}/{strategy}", results[0][strategy]["state"], tmp_path, capsys)
    zero2 = objects(s3, "world/zero2")
    assert any("optim_states" in k and "zero_pp_rank_1" in k for k in zero2), zero2  # rank 1's ZeRO shard


@pytest.mark.timeout(180)
def test_a_kill_mid_commit_leaves_the_previous_checkpoint_valid_and_auto_resumes(s3, tmp_path, capsys):
    url = f"s3://{s3_server.BUCKET}/killed"
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "s3_kill_run.py"), url, "8", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == -9, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    keys = objects(s3, "killed")
    # step 4 was mid-commit: its temporary prefix is still there and its final prefix has no manifest.
    assert committed_steps(keys) == ["step-00000002"], keys
    assert any(k.startswith(".step-00000004.partial/") for k in keys), keys
    assert any(k.startswith("step-00000004/") for k in keys), keys
    assert s3.fs().cat_file(f"{s3_server.BUCKET}/killed/latest").decode().strip() == "step-00000002"
    main(["checkpoint", "verify", url])
    assert "ok" in capsys.readouterr().out
    # auto resumes from step 2 and ends where an uninterrupted run ends.
    full = train("single", max_steps=8, **SMALL)
    resumed = train("single", max_steps=8, checkpoint_dir=url, checkpoint_every_n_steps=2, ckpt_path="auto", **SMALL)
    assert [h["step"] for h in resumed["history"]] == [2, 3, 4, 5, 6, 7]
    assert max_abs_diff(resumed["state"], full["state"]) == 0.0
    keys = objects(s3, "killed")
    assert not [k for k in keys if ".partial" in k], keys  # the interrupted save's leftovers are gone
    # ...and so is its manifest-less step-4 copy: the resumed run committed step 4 under its plain name.
    assert committed_steps(keys) == ["step-00000002", "step-00000004", "step-00000006", "step-00000008"], keys
    assert {k.split("/")[0] for k in keys if k.startswith("step-")} == set(committed_steps(keys)), keys


class Steps:
    def __init__(self) -> None:
        self.fits = 0

    @unison.hookimpl
    def unison_on_fit_start(self) -> None:
        self.fits += 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("key", "secret", "server_says"),
    [
        (s3_server.KEY, "not-the-secret", "signature"),
        ("unknown-key", s3_server.SECRET, "access key"),
    ],
)
def test_credentials_the_server_refuses_fail_clearly_before_training(s3, monkeypatch, key, secret, server_says):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    steps = Steps()
    trainer = unison.Trainer(
        strategy="single",
        max_steps=2,
        global_batch_size=16,
        progress="off",
        checkpoint_dir=f"s3://{s3_server.BUCKET}/refused",
        callbacks=[steps],
    )
    with pytest.raises(unison.ConfigurationError, match="refused access") as err:
        trainer.fit(
            torch.nn.Linear(8, 1),
            torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1)),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
    message = str(err.value)
    assert "checkpoint_dir" in message and server_says in message.lower() and "AWS_ACCESS_KEY_ID" in message
    assert steps.fits == 0 and not trainer.setup_started
    assert objects(s3, "refused") == []


@pytest.mark.timeout(60)
def test_a_missing_bucket_is_named(s3):
    trainer = unison.Trainer(
        strategy="single", max_steps=2, global_batch_size=16, progress="off", checkpoint_dir="s3://no-such-bucket/run"
    )
    with pytest.raises(unison.ConfigurationError, match=r"'no-such-bucket'.*does not exist"):
        trainer.fit(
            torch.nn.Linear(8, 1),
            torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1)),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )


def test_an_unknown_scheme_is_refused_when_the_trainer_is_built(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(unison.ConfigurationError, match=r"checkpoint_dir.*'gs'.*registered: file://, s3://"):
        unison.Trainer(strategy="single", max_steps=2, checkpoint_dir="gs://bucket/run")
    assert list(tmp_path.iterdir()) == []  # no local directory named "gs:"


@pytest.mark.timeout(60)
def test_s3_without_s3fs_is_refused_naming_the_extra(tmp_path):
    code = (
        "import sys; sys.modules['s3fs'] = None\n"  # an interpreter where s3fs cannot be imported
        "import unison\n"
        "try:\n"
        "    unison.Trainer(strategy='single', max_steps=2, checkpoint_dir='s3://bucket/run')\n"
        "except unison.ConfigurationError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=50)
    assert "s3fs" in out.stdout and "unison[s3]" in out.stdout, (out.stdout, out.stderr)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_explicit_storage_options_without_any_aws_variable(s3, monkeypatch):
    """``open_storage(url, storage_options)`` is the whole configuration: no AWS_* variable is read."""
    from unison.checkpointing.checkpointer import Checkpointer
    from unison.checkpointing.storage import open_storage

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    options = {"key": s3_server.KEY, "secret": s3_server.SECRET, "endpoint_url": s3.endpoint}
    root, storage = open_storage(f"s3://{s3_server.BUCKET}/explicit", options)
    assert str(root) == f"s3://{s3_server.BUCKET}/explicit"
    checkpointer = Checkpointer(root, storage=storage)
    checkpointer.admission.claim(None)

    def write(directory: Path) -> dict:
        (directory / "state").mkdir(parents=True)
        torch.save({"w": torch.arange(4.0)}, directory / "state" / "w.pt")
        return {"strategy": "single", "world_size": 1, "precision": "32-true", "state_dict": {}}

    final = checkpointer.save(3, write)
    assert str(final) == f"s3://{s3_server.BUCKET}/explicit/step-00000003"
    assert objects(s3, "explicit") == ["latest", "step-00000003/manifest.json", "step-00000003/state/w.pt"]
    found = checkpointer.select("auto")
    local = storage.localize(found.path / "state")
    assert torch.equal(torch.load(local / "w.pt")["w"], torch.arange(4.0))
