"""Test harness: sglang 0.5.23's real HiCache controller on CPU, and a tiny
in-memory L3 backend that validates it."""
