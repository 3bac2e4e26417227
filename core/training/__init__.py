"""The training loop, by concern.

* :mod:`~unison.training.trainer` - the public :class:`~unison.training.trainer.Trainer` composing the rest;
* :mod:`~unison.training.declaration` - the strategy checked against the settings (:func:`declare`);
* :mod:`~unison.training.preflight` - every other check before any process group, returning a ``FitPlan``;
* :mod:`~unison.training.record` - one fit's values and parts, the trainer's only record of a fit;
* :mod:`~unison.training.world` - the process group, replicas made equal, the precision on the device;
* :mod:`~unison.training.loop` - optimizer steps, accumulation, non-finite handling, the agreed stop;
* :mod:`~unison.training.validation`, :mod:`~unison.training.checkpointing` - when to validate and to save,
  and what a checkpoint holds;
* :mod:`~unison.training.metrics` - metrics on their way to the loggers;
* :mod:`~unison.training.outputs` - :class:`StepOutput`, :class:`Progress`, :class:`NonFiniteError`;
* :mod:`~unison.training.runs` - run directories (:class:`RunPlace`: where a fit writes).
"""
