"""The Mooncake side: the one module that calls the native store (``client``),
its circuit breaker, an in-memory fake held to the real client by a shared
contract suite, and the cluster-wide layout guard. Nothing here imports sglang.
"""
