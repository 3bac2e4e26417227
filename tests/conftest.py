"""Fixtures shared by test modules (the S3 server, started only by the tests that ask for it), the
test tiers, and a per-module time summary.

Tiers: the README's test command (``-m "not full"``) is the quick tier; the modules in
:data:`FULL_TIER` are the long tier that ``.ci/run`` runs as its own step (``-m full``). Every module
is in exactly one tier; both together are the whole suite. Both tiers run in two test processes
(pytest-xdist, ``-n 2 --dist loadfile``): every test of a module runs in the same process, so a module's
fixtures (its shared worlds and reference runs) are built once.

Trainers without a ``root_dir`` or loggers write their default metrics under ``$UNISON_RUNS_ROOT``:
set here, before any test module builds its subprocess environment, to a directory removed at exit,
so no test (or world it starts) leaves ``runs/`` in the checkout.
"""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import tempfile
import time

import pytest
import s3_server

if "UNISON_RUNS_ROOT" not in os.environ:
    _runs = tempfile.mkdtemp(prefix="unison-test-runs-")
    os.environ["UNISON_RUNS_ROOT"] = _runs
    atexit.register(shutil.rmtree, _runs, True)


# Module -> why it runs in the long tier (minutes each; their behaviour is also covered in the quick tier
# by the per-backend and CLI tests or by the conformance steps of .ci/run, or they repeat runs on purpose).
FULL_TIER = {
    "test_lifecycle_stress.py": "repeats whole 2-rank runs to catch rare failures",
    "test_conformance_broken.py": "the mutation suites: every deliberately broken strategy through the suite",
    "test_conformance_rules.py": "the mutation suites (diagnosis rules)",
    "test_conformance_diagnoses.py": "the mutation suites (diagnoses decided by direct evidence)",
    "test_conformance_optim.py": "the mutation suites (optimizer state on resume)",
    "test_conformance_workloads.py": "the mutation suites (token losses, default plugins, resume in new processes)",
    "test_conformance_precision.py": "the mutation suites (precision applied)",
    "test_conformance_rules_w4.py": "the mutation suites at world 4 (4-rank worlds)",
    "test_conformance.py": "the suite on the test and example strategies, every scenario",
    "test_multinode.py": "two torchrun agents as two nodes",
    "test_multinode_cluster.py": "two torchrun agents per cluster environment",
    "test_multinode_s3.py": "two torchrun agents as two nodes, checkpointing to object storage and resuming",
    "test_launch_failures.py": "fault injection: a rank of a 2-process job failing in each way, one job at a time",
    "test_lifecycle.py": "fault injection: worker restarts in a row, preemption signals, rendezvous timeouts",
    "test_watchdog.py": "fault injection: frozen and stopped ranks, waiting out stall timeouts by design",
    "test_s3_uploads.py": "fault injection: uploads held past the client's timeout by a slow proxy, landing late",
    "test_two_fits.py": "three plain torchrun jobs of two fits each, to catch a rendezvous that fails 1 in 4",
    "test_watchdog_collectives.py": "fault injection: a stopped rank, waiting out a stall timeout by design",
    "test_prometheus.py": "a real Prometheus and Pushgateway started, scraping a 2-rank job (12-30 s)",
    "test_s3_run_directories.py": "fault injection: object-storage uploads that fail and are retried",
    "test_storage_outage.py": "fault injection: an S3 server stopped mid-save, retried within its budget",
    "test_compile_inductor.py": "torch.compile with inductor: code generation takes seconds per graph",
    "test_hsdp.py": "4-rank worlds (hsdp on a 2x2 mesh, cross-backend resumes)",
    "test_fsdp_tp.py": "4-rank worlds (fsdp_tp on a 2x2 mesh, cross-backend resumes)",
    "test_pipeline_fsdp.py": "4-rank worlds (pipeline_fsdp on a 2x2 mesh, cross-backend resumes)",
    "test_conformance_broken_composed.py": "the mutation suites for composed strategies at world 4",
    "test_torch_zero_fairscale.py": "three sharded-optimizer backends' worlds; .ci/run's matrix certifies them",
    "test_apex_distributed.py": "18 two-rank runs of the apex strategy on a named stand-in (apex is CUDA-only)",
    "test_compat_plugins_certified.py": "the suite on the plugins kept for each released API (2-rank worlds, compile)",
    "test_token_loss_w4.py": "a 4-rank world (token-weighted losses under hsdp, fsdp_tp, pipeline_fsdp, ddp)",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in FULL_TIER:
            item.add_marker(pytest.mark.full)


#: Wall-clock budgets in seconds on this project's 2-core CI machine, on a quiet machine: the README's test
#: command (the quick tier) and the whole of ``.ci/run``, which reads them from here and reports its steps'
#: times against them. Going over is a warning naming the step, never a failure (the machines are shared
#: and timings are noisy); a run that is over on a quiet machine needs its tests made cheaper.
BUDGET_S = {"quick tier": 600, "ci": 2700}

_module_seconds: collections.Counter[str] = collections.Counter()
_session_started = time.monotonic()


def pytest_runtest_logreport(report):
    _module_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _module_seconds:
        return
    terminalreporter.section("seconds per test module (setup + call + teardown)")
    for module, seconds in _module_seconds.most_common(30):
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")
    # Summed over the test processes: with two, the total is about twice the wall time printed below.
    wall = time.monotonic() - _session_started
    terminalreporter.write_line(f"{sum(_module_seconds.values()):8.1f}  total ({wall:.0f} s wall)")
    if terminalreporter.config.getoption("markexpr") == "not full" and wall > BUDGET_S["quick tier"]:
        terminalreporter.write_line(
            f"WARNING: budget: the quick tier (the README's test command) took {wall:.0f} s, over its budget of "
            f"{BUDGET_S['quick tier']} s (tests/conftest.py BUDGET_S); the slowest modules are listed above",
            yellow=True,
        )


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


@pytest.fixture(scope="session")
def single_runs():
    """The single-process reference runs of ``helpers.REFERENCE_RUNS`` by name, each trained on first use and
    kept for the session (the test process): ``single_runs("fp32")``. Each call returns its own copy, so a
    test that changes what it got leaves the next test's alone."""
    import copy

    import helpers

    done: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in done:
            done[name] = helpers.train("single", **helpers.REFERENCE_RUNS[name]())
        return copy.deepcopy(done[name])

    return get
