"""The Mooncake side: the one module that calls the native store (``client``),
its circuit breaker, and the cluster-wide layout guard. Nothing here imports
sglang. The in-memory fake the tests use lives in ``mooncake_span_tools.testing``.
"""
