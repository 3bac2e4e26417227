"""The training loop: the :class:`~unison.training.trainer.Trainer` and its run directories
(:mod:`~unison.training.runs`).
"""
