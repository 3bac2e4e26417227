"""Storage backends are found by URL scheme through the ``unison_storage_backends`` hook.

A third-party scheme (``memtest://``, :mod:`memtest_storage`: a real storage on a local
directory) checkpoints and resumes like ``s3://``; the built-in ``s3`` backend registers
through the same hook; an unknown scheme names the registered ones.
"""

from __future__ import annotations

import memtest_storage
import pytest
import torch

import unison
from unison.checkpointing.storage import LocalStorage, open_storage
from unison.plugin.manager import PluginManager
from unison.plugins.storage import s3 as s3_backend

from helpers import train

SMALL = {"accumulate_grad_batches": 2, "global_batch_size": 16, "record": False, "progress": "off"}


@pytest.fixture
def memtest(tmp_path, monkeypatch):
    """``memtest://`` registered through UNISON_PLUGINS, its objects under ``tmp_path/objects``."""
    monkeypatch.setenv("UNISON_PLUGINS", "memtest_storage")
    monkeypatch.setenv("MEMTEST_STORAGE_ROOT", str(tmp_path / "objects"))
    monkeypatch.chdir(tmp_path)
    memtest_storage.CALLS.clear()
    return tmp_path / "objects"


@pytest.mark.timeout(120)
def test_a_third_party_scheme_checkpoints_and_resumes_bitwise(memtest):
    url = "memtest://bucket/run"
    full = train("single", max_steps=8, **SMALL)
    ckpt = {"checkpoint_dir": url, "checkpoint_every_n_steps": 2, "keep_last_n_checkpoints": 2, "ckpt_path": "auto"}
    first = train("single", max_steps=4, **ckpt, **SMALL)
    assert [h["step"] for h in first["history"]] == [0, 1, 2, 3]
    resumed = train("single", max_steps=8, **ckpt, **SMALL)
    assert [h["step"] for h in resumed["history"]] == [4, 5, 6, 7]
    assert all(torch.equal(resumed["state"][k], full["state"][k]) for k in full["state"])
    # The checkpoints are in the backend's directory, retained and committed through it.
    run = memtest / "bucket" / "run"
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000006", "step-00000008"]
    assert (run / "latest").read_text().strip() == "step-00000008"
    assert (run / "step-00000008" / "manifest.json").is_file()
    assert memtest_storage.CALLS["commit_dir"] >= 4 and memtest_storage.CALLS["localize"] >= 1
    assert not list(memtest.parent.glob("memtest*"))  # never a local directory named after the URL


def test_open_storage_returns_the_registered_factorys_storage(memtest):
    root, storage = open_storage("memtest://bucket/x", {"base": str(memtest / "elsewhere")}, "logging.dir")
    assert str(root) == "memtest://bucket/x" and isinstance(storage, memtest_storage.DirectoryStorage)
    assert storage.base == memtest / "elsewhere"  # the storage options reached the factory


def test_an_unknown_scheme_names_the_registered_ones(memtest):
    with pytest.raises(unison.ConfigurationError, match=r"logging\.dir.*'gs'.*file://, memtest://, s3://"):
        open_storage("gs://bucket/run", option="logging.dir")
    assert not list(memtest.parent.glob("gs*"))


def test_the_s3_backend_registers_through_the_hook_like_a_third_party():
    backends = PluginManager(lazy=True).unison_storage_backends()
    assert backends["s3"] is s3_backend.open_s3
    blocked = PluginManager(lazy=True, blocked=["s3"]).unison_storage_backends()
    assert "s3" not in blocked  # no second, hard-wired path


def test_local_paths_never_ask_a_plugin(tmp_path):
    class Refuses:
        @unison.hookimpl
        def unison_storage_backends(self):
            raise AssertionError("asked for a local path")

    pm = PluginManager([Refuses()], autoload=False)
    for location in (tmp_path / "ckpt", f"file://{tmp_path}/ckpt"):
        root, storage = open_storage(location, plugins=pm)
        assert root == tmp_path / "ckpt" and type(storage) is LocalStorage


def test_a_scheme_registered_twice_names_both_plugins():
    class Again:
        @unison.hookimpl
        def unison_storage_backends(self):
            return {"S3": s3_backend.open_s3}

    pm = PluginManager([Again()])
    with pytest.raises(unison.PluginError, match=r"'s3' registered by both 's3' and "):
        pm.unison_storage_backends()
