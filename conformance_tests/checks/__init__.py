"""The checks a verdict is made of, by concern.

* :mod:`~unison.conformance.checks.numeric`: per-step numbers, checkpoint buffers and the
  final state against another run, within the precision's tolerance (the :class:`Checker`
  that collects divergences);
* :mod:`~unison.conformance.checks.premises`: the reference run really shows what the scenario
  exists to see (clipping clips, an overflow skips a step, buffers change);
* :mod:`~unison.conformance.checks.ranks`: every rank of a world saw and ended with the same;
* :mod:`~unison.conformance.checks.sync`: gradient collectives and engine boundaries follow the
  declared accumulation;
* :mod:`~unison.conformance.checks.declared`: refusals and precision declarations;
* :mod:`~unison.conformance.checks.runs`: one run against another (its twin in the reference, the
  uninterrupted truth, the full-batch run, a run it must equal bit for bit);
* :mod:`~unison.conformance.checks.reported`: what the strategy reports, builds and writes (its
  optimizer's groups, the optimizer state a resume gives back, the dtype of its gradient reductions).
"""
