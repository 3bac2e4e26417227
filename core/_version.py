"""The version of unison (``unison.__version__``; the distribution's version in ``pyproject.toml`` is the same)."""

__version__ = "0.2.0"
