"""``python -m unison.cli``: the ``unison`` command."""

from unison.cli import main

if __name__ == "__main__":
    main()
