"""``python -m unison.cli``: the ``unison`` command."""

from unison.cli import main

main()
