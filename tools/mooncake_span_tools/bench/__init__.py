"""Benchmarks and the demo (the host-pool builders are in ``mooncake_span_tools.testing``).

Never imported by the runtime backend.
"""
