"""The conformance suite certifies the plugins kept for plugin API 2.0 to 2.3 (tests/compat_plugins/) unchanged
on the current version: a minor version is additive only if this holds.

One suite run (2-rank gloo worlds) on the scenarios where the versions differ: ``plain`` and
``accumulation`` (what every version trains), ``compile`` and ``activation_checkpointing`` (added in 2.1,
applied by the setup template), ``token_loss`` (``(loss_sum, num_items)`` losses, 2.3: a strategy on the
trainer's accumulation path takes them whatever version it was written for). The 2.0 plugin overrides
``setup`` and never applies the features: those two are *declared out* with the reason, never failed; the
2.1 plugin (on the template), the 2.2 one (a ``setup`` override applying them with
``unison.contract.transforms``) and the 2.3 one (the ``build`` hook) prove them, the suite's probes seeing
frames compiled and forwards recomputed. None of them answers ``reports_step_losses`` (2.4): their losses
are summed with ``reduce_sum``.
"""

from __future__ import annotations

import pytest
from compat_plugins import PLUGINS

from unison.conformance.certification import certify
from unison.conformance.report import SuiteReport
from unison.conformance.suite import Suite
from unison.conformance.verdict import DECLARED_OUT, PASS

from helpers import suite_report_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCENARIOS = ["plain", "accumulation", "compile", "activation_checkpointing", "token_loss"]
SUPPORTED = {module: name for module, (version, name) in PLUGINS.items() if version != "1.x"}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> SuiteReport:
    with Suite(
        world_size=2,
        scenarios=SCENARIOS,
        plugins=list(SUPPORTED),
        timeout=300,
        workdir=tmp_path_factory.mktemp("compat-plugins"),
    ) as suite:
        return certify(list(SUPPORTED.values()), suite=suite, report_dir=suite_report_dir(tmp_path_factory, "compat"))


@pytest.mark.parametrize("name", sorted(SUPPORTED.values()))
def test_every_kept_2x_plugin_is_certified_unchanged(report, name):
    statuses = {n: v.status for n, v in report.verdicts[name].items()}
    assert report.certificate(name).certified, {n: v.summary() for n, v in report.verdicts[name].items()}
    assert statuses["plain"] == statuses["accumulation"] == statuses["token_loss"] == PASS, statuses
    if name == "compat_2_0":
        for feature in ("compile", "activation_checkpointing"):
            v = report.verdicts[name][feature]
            assert v.status == DECLARED_OUT, v.summary()
            assert f"declares {feature} refused: the strategy overrides setup and does not apply features" in v.reason
    else:
        assert statuses["compile"] == statuses["activation_checkpointing"] == PASS, statuses
        checks = " ".join(
            report.verdicts[name]["compile"].checks + report.verdicts[name]["activation_checkpointing"].checks
        )
        assert "compiled at least one frame" in checks and "FLOPs" in checks
