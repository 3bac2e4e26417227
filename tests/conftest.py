"""Fixtures shared by test modules: the S3 server (started only by the tests that ask for it).

Trainers without a ``root_dir`` or loggers write their default metrics under ``$UNISON_RUNS_ROOT``:
set here, before any test module builds its subprocess environment, to a directory removed at exit,
so no test (or world it starts) leaves ``runs/`` in the checkout.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import s3_server

if "UNISON_RUNS_ROOT" not in os.environ:
    _runs = tempfile.mkdtemp(prefix="unison-test-runs-")
    os.environ["UNISON_RUNS_ROOT"] = _runs
    atexit.register(shutil.rmtree, _runs, True)


@pytest.fixture(scope="session")
def s3():
    """A real S3 server (SeaweedFS on 127.0.0.1, see ``s3_server.py``) for the whole session."""
    server = s3_server.start()
    yield server
    server.stop()


@pytest.fixture
def aws_env(s3, monkeypatch):
    """The standard AWS variables pointing at the test server (and nothing from the host's own AWS setup)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
