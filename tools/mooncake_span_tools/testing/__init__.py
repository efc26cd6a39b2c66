"""Test support shared by the tests and the benchmark: the in-memory fake
store (``fake_store``, its registered-memory rule in ``registered_ranges``) and
real sglang 0.5.23 host-pool builders on CPU (``pools``, ``device_pools``,
``page_io``, ``sglang_cpu``, ``stock_glm``). The fake store's classes are
importable from the package itself.

The runtime packages (``span/``, ``store/``, ``sglang_backend/`` and the
top-level modules) never import this package; ``bench/`` and the tests may.
"""

from mooncake_span_tools.testing.fake_store import FakeCluster, FakeReplicateConfig, FakeStore

__all__ = ["FakeCluster", "FakeReplicateConfig", "FakeStore"]
