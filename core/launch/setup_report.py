"""What a run is setting up, said as it starts: ``unison: setting up ...`` lines.

The phases before the first step can each take from seconds to minutes (starting
the process group waits for every rank; a strategy's setup wraps, shards or
compiles; a resume reads a checkpoint). :class:`SetupReport` says what is being
set up as each phase begins, so that a slow start is never a silent one. Like
``unison: resuming from step N``, the lines go to stderr on global rank 0 only,
and not at all with ``progress="off"``.
"""

from __future__ import annotations

from unison.launch import messages


class SetupReport:
    """Prints ``unison: setting up WHAT`` on global rank 0's stderr unless progress is ``"off"``."""

    def __init__(self, progress: str, rank: int) -> None:
        self.enabled = progress != "off" and rank == 0

    def __call__(self, what: str) -> None:
        if self.enabled:
            messages.say(f"unison: setting up {what}")
