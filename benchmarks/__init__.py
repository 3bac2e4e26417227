"""unison benchmarks: overhead per backend, a peer framework, framework time, memory, scaling.

Run ``python -m benchmarks`` (see ``benchmarks/__main__.py``).
"""
