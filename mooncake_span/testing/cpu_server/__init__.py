"""Real sglang servers on a CPU-only host: stand-ins, tiny models, processes.

``standins`` fills what sglang 0.5.23 lacks without CUDA; ``site`` is the
folder a server's ``PYTHONPATH`` gets so every process of it installs them;
``models`` makes tiny random-weight models locally; ``servers`` starts and
talks to ``sglang.launch_server`` and ``sglang_router`` processes.
"""

from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "site"
