"""What real sglang servers need on a CPU-only host: stand-ins and tiny models.

``standins`` fills what sglang 0.5.23 lacks without CUDA; ``site`` is the
folder a server's ``PYTHONPATH`` gets so every process of it installs them;
``models`` makes tiny random-weight models locally. The processes themselves
are started by :mod:`mooncake_span_tools.lab.sglang_servers`.
"""

from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "site"
