"""Keep Mooncake's native (glog) lines off the terminal of the CLI commands.

The native client logs every setup, connection and segment mount to fd 2 at
INFO; the commands send those lines to a file (docs/operating.md, "Native logs").
"""

from __future__ import annotations

import os
import tempfile
from typing import Any


def add_native_log_arg(parser: Any) -> None:
    parser.add_argument(
        "--native-log",
        metavar="PATH",
        help="file for Mooncake's native log lines (default: a new temporary file, printed at "
        "the end; '-' shows them on stderr)",
    )


def resolve_native_log(choice: str | None, command: str) -> str | None:
    """The log file for ``--native-log`` (None: leave fd 2 alone)."""
    if choice == "-":
        return None
    if choice:
        return choice
    directory = tempfile.mkdtemp(prefix=f"mooncake-span-{command}-")
    return os.path.join(directory, "native.log")
