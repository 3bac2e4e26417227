"""The diagnosis rules, grouped by the evidence they read.

:func:`unison.conformance.diagnosis.table.diagnose` walks its table of these rules in
order of precedence; each rule is a small function of the
:class:`~unison.conformance.diagnosis.evidence.Evidence` that returns a finding
(the diagnosis rule's name, the divergence that shows it, why) or ``None``.

* :mod:`~unison.conformance.diagnosis.declared`: refusals, errors, declarations,
  premises, precision and validation (what the comparison already named);
* :mod:`~unison.conformance.diagnosis.scale`: a gradient scale error (fixed
  divisor, averaged twice, summed, accumulation, a tied weight counted twice);
* :mod:`~unison.conformance.diagnosis.resume`: what a resume did not restore;
* :mod:`~unison.conformance.diagnosis.reported`: what the strategy built, sent and
  reported (reduction dtypes, parameter groups, state-dict names, where gradients
  were reduced, the grad norm returned, frozen parameters, buffer counters);
* :mod:`~unison.conformance.diagnosis.update`: initial weights, buffers,
  replicas, gradient sync, clipping, the optimizer and scheduler, hooks, counts.
"""
