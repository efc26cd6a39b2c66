"""mooncake-span's tooling, installed beside the serving distribution: the
benchmarks (``bench``), the lab (``lab``: real sglang servers, network
namespaces, the demos, the soak), the CPU stand-ins and test support
(``testing``), and the ``mooncake-span`` commands they add (``commands``).

It builds on ``mooncake_span`` (the runtime and the operator commands); nothing
in ``mooncake_span`` imports it.
"""
