"""What each process ``unison run`` starts executes: ``python -m unison.launch.worker [--module] TARGET ARGS``.

It runs the user's script (or module, with ``--module``) as ``__main__``,
exactly as ``python script.py ARGS`` would (same ``sys.argv``, the script's
directory first on ``sys.path``), and turns the exception that ends it into
an exit code and a record for the launcher
(:func:`unison.launch.lifecycle.report_worker_failure`): 2 for a
ConfigurationError, 1 for anything else. The launcher then prints one report
for the job instead of one traceback per rank.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    as_module = bool(argv) and argv[0] == "--module"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m unison.launch.worker [--module] SCRIPT|MODULE [ARGS...]")
    target, args = argv[0], argv[1:]
    try:
        if as_module:
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        from unison.launch.lifecycle import report_worker_failure

        sys.exit(report_worker_failure(exc))


if __name__ == "__main__":
    main(sys.argv[1:])
