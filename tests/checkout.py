"""This checkout's two source roots, for the processes tests start with their
own ``PYTHONPATH``: the serving package at the root, the tooling under tools/."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join([str(ROOT), str(ROOT / "tools")])
