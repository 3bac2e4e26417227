"""The markers a unison plugin needs, and nothing else.

A plugin is any module or object with functions named after the hookspecs in
:mod:`unison.plugin.hookspecs`, each decorated with :data:`hookimpl`. A complete,
working plugin that logs the loss and stops nothing::

    # my_plugin.py
    import unison

    class PrintLoss:
        @unison.hookimpl
        def unison_on_train_step_end(self, trainer, step, output):
            if trainer.is_global_zero:
                print(f"step {step}: loss {output.loss:.4f}")

    trainer = unison.Trainer(strategy="single", callbacks=[PrintLoss()], ...)

To ship it to other users, publish it under the ``unison`` entry-point group
(``[project.entry-points.unison] print_loss = "my_plugin"``); unison loads it
at start-up exactly like its own built-in strategies and plugins. A module-level
plugin may implement only some hooks, and a hook implementation may accept any
subset of the spec's arguments (pluggy passes them by name).

To run code around other implementations, use a new-style wrapper,
``@unison.hookimpl(wrapper=True)``: it gets the other implementations' results
from ``yield`` and returns what the caller sees. Every hook, the registration
hooks included, is called through pluggy, so a wrapper of
``unison_strategies`` sees (and may filter) what each plugin registers.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "unison"

#: Marks a function as the specification of a hook (used only in hookspecs.py).
hookspec = pluggy.HookspecMarker(PROJECT_NAME)

#: Marks a function as the implementation of a hook.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]
