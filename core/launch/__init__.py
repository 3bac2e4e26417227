"""Starting worlds of processes and how each process lives and ends.

* :mod:`~unison.launch.torchrun` - ``unison run``/``unison train`` hand the world to torchrun;
* :mod:`~unison.launch.worker` - what every started process executes;
* :mod:`~unison.launch.report` - the one failure report of a job;
* :mod:`~unison.launch.lifecycle` - joining the world, stop requests, exit codes;
* :mod:`~unison.launch.watchdog` - a rank that stops making progress is named within seconds;
* :mod:`~unison.launch.cluster` - cluster environments across nodes;
* :mod:`~unison.launch.setup_report` - what a run is setting up, said as it starts.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """The names of the 0.1 module ``unison.launch`` (``spawn``...), from their homes
    today, each use with a DeprecationWarning naming the home (until 0.3; :mod:`unison._moved`)."""
    from unison._moved import old_name

    return old_name(__name__, name)
