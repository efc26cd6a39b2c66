"""Keep Mooncake's native (glog) lines off the terminal of the CLI commands.

The native client logs every setup, connection and segment mount to fd 2 at
INFO; ``mooncake-span demo`` printed about 30 such lines before its own six.
The commands send fd 2 to a log file instead (``--native-log PATH``; ``-``
keeps them on stderr) and say where it is. Python's own logging and the
commands' messages keep going to the real stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

# The native library reads its level once, when it is loaded.
LEVEL_ENV = "MC_LOG_LEVEL"


def add_native_log_arg(parser: Any) -> None:
    parser.add_argument(
        "--native-log",
        default=None,
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


@contextlib.contextmanager
def native_stderr_to(path: str | None) -> Iterator[Any]:
    """Send fd 2 (Mooncake's glog lines) to ``path``; yield a stream on the real stderr.

    Handlers of the root logger that wrote to the old stderr follow the real
    one, so warnings stay visible.
    """
    if path is None:
        yield sys.stderr
        return
    sys.stderr.flush()
    saved = os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    real = os.fdopen(os.dup(saved), "w", buffering=1)
    old_stderr = sys.stderr
    sys.stderr = real
    handlers = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is old_stderr
    ]
    for h in handlers:
        h.setStream(real)
    try:
        yield real
    finally:
        for h in handlers:
            h.setStream(old_stderr)
        sys.stderr = old_stderr
        real.flush()
        os.dup2(saved, 2)
        os.close(saved)
        real.close()
