"""Benchmarks, the demo and real sglang host-pool builders on CPU.

Never imported by the runtime backend.
"""
