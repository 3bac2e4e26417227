"""Strategy plugins written against each released version of the plugin API, kept as they were written.

Each module is a plugin as the strategy-plugin page of its version told an author to write it (``git log -p
docs/strategy-plugins.md``), registered under its own name. They are never edited to follow the current
API: ``tests/test_compat_plugins.py`` checks that registration refuses the 1.x one with its migration and
that the conformance suite certifies the others unchanged. A version is additive only if they pass.
"""

#: Plugin module -> (the API it was written for, the strategy it registers).
PLUGINS = {
    "compat_plugins.api_1x": ("1.x", "compat_1x"),
    "compat_plugins.api_2_0": ("2.0", "compat_2_0"),
    "compat_plugins.api_2_1": ("2.1", "compat_2_1"),
    "compat_plugins.api_2_2": ("2.2", "compat_2_2"),
    "compat_plugins.api_2_3": ("2.3", "compat_2_3"),
}
