"""Runs at start-up in every Python process whose PYTHONPATH holds this folder.

Only servers started by mooncake-span's test support and demo get it: it puts
the CPU stand-ins of :mod:`mooncake_span_tools.testing.cpu_server.standins` in place
before sglang is imported (a no-op where CUDA is present).
"""

from mooncake_span_tools.testing.cpu_server.standins import install

install()
