"""The checks a verdict is made of, by concern.

* :mod:`~unison.conformance.checks.numeric`: per-step numbers, checkpoint buffers and the
  final state against another run, within the precision's tolerance (the :class:`Checker`
  that collects divergences);
* :mod:`~unison.conformance.checks.premises`: the reference run really shows what the scenario
  exists to see (clipping clips, an overflow skips a step, buffers change);
* :mod:`~unison.conformance.checks.ranks`: every rank of a world saw and ended with the same;
* :mod:`~unison.conformance.checks.sync`: gradient collectives and engine boundaries follow the
  declared accumulation;
* :mod:`~unison.conformance.checks.declared`: refusals and precision declarations.
"""
