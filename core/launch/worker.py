"""What each process ``unison run`` starts executes: ``python -u -c BOOT [--module] TARGET ARGS``.

It runs the user's script (or module, with ``--module``) as ``__main__``,
exactly as ``python script.py ARGS`` would (same ``sys.argv``, the script's
directory first on ``sys.path``), and turns the exception that ends it into
an exit code and a record for the launcher
(:func:`unison.launch.lifecycle.report_worker_failure`): 2 for a
ConfigurationError, 1 for anything else. The launcher then prints one report
for the job instead of one traceback per rank.

A safe ``sys.path``: code runs only from the trust roots the user named and
installed packages, never from the working directory by accident. ``python -m
unison.launch.worker`` would put the working directory first on ``sys.path``
before a line of this module runs, so a ``json.py`` there would be imported by
every worker. The launcher therefore starts workers with :data:`BOOT`
(``python -c``), whose first statement takes that entry off ``sys.path``
before anything else is imported (the same on Python 3.10, which has no
``-P``). Then:

* a script: its own directory goes first on ``sys.path`` (as ``python
  script.py`` does), the working directory does not;
* a module (``--module pkg.train``): run from the installed packages when it is
  one of them (``unison train``'s workers run ``unison.cli`` this way); only a
  module found nowhere else is looked up in the working directory, as ``python
  -m pkg.train`` would, because the user named it there.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

#: The code a worker process starts with (``python -u -c BOOT ARGS``): drop the working directory that
#: ``-c`` puts first on ``sys.path`` (unless ``-P``/``PYTHONSAFEPATH`` or ``-I`` kept it off), then run main.
BOOT = (
    "import sys\n"
    "if not (getattr(sys.flags, 'safe_path', False) or sys.flags.isolated): del sys.path[0]\n"
    "from unison.launch.worker import main\n"
    "main(sys.argv[1:])"
)


def _installed(module: str) -> bool:
    """Whether ``module`` is found on ``sys.path`` as it is (without the working directory)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def main(argv: list[str]) -> None:
    as_module = bool(argv) and argv[0] == "--module"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -c unison.launch.worker.BOOT [--module] SCRIPT|MODULE [ARGS...]")
    target, args = argv[0], argv[1:]
    try:
        sys.argv = [target, *args]
        if as_module:
            if not _installed(target):
                sys.path.insert(0, os.getcwd())  # the user's module in the working directory, as python -m finds it
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        from unison.launch.lifecycle import report_worker_failure

        sys.exit(report_worker_failure(exc))


if __name__ == "__main__":
    # python -m unison.launch.worker (the form of earlier versions): -m put the working directory first.
    if not (getattr(sys.flags, "safe_path", False) or sys.flags.isolated):
        del sys.path[0]
    main(sys.argv[1:])
