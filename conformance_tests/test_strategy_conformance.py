"""The conformance suite as pytest tests (collected by ``pytest --pyargs unison.conformance``).

Needs the plugin's options: ``pytest -p unison.conformance.pytest_plugin
--pyargs unison.conformance --unison-strategy NAME``. Without them every case
is skipped with the command line to use.
"""

from unison.conformance.pytest_plugin import generate_tests as pytest_generate_tests  # noqa: F401
from unison.conformance.pytest_plugin import unison_conformance  # noqa: F401  (the fixture)


def test_conformance(unison_case, unison_conformance):  # noqa: F811
    strategy, scenario = unison_case
    unison_conformance.check(strategy, scenario)
