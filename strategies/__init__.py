"""Built-in strategies: one module per backend family, each a pluggy plugin.

They register through the ``unison`` entry-point group exactly like
third-party strategies; importing this package registers nothing.
"""
