"""Starting worlds of processes and how each process lives and ends.

* :mod:`~unison.launch.torchrun` - ``unison run``/``unison train`` hand the world to torchrun;
* :mod:`~unison.launch.worker` - what every started process executes;
* :mod:`~unison.launch.report` - the one failure report of a job;
* :mod:`~unison.launch.lifecycle` - joining the world, stop requests, exit codes;
* :mod:`~unison.launch.watchdog` - a rank that stops making progress is named within seconds;
* :mod:`~unison.launch.cluster` - cluster environments across nodes;
* :mod:`~unison.launch.setup_report` - what a run is setting up, said as it starts.
"""
