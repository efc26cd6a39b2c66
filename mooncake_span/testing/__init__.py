"""Test support shared by the tests and the benchmark: the in-memory fake
store (``fake_store``) and real sglang 0.5.23 host-pool builders on CPU
(``pools``, ``device_pools``, ``page_io``, ``sglang_cpu``, ``stock_glm``).

The runtime packages (``span/``, ``store/``, ``sglang_backend/`` and the
top-level modules) never import this package; ``bench/`` and the tests may.
"""
