"""Keep Mooncake's native (glog) lines off the terminal of the tooling's in-process commands.

A native client set up in this process logs every setup, connection and
segment mount to fd 2 at INFO; ``mooncake-span demo`` printed about 30 such
lines before its own six. ``bench``, ``demo-span`` and ``soak`` send fd 2 to
the file ``--native-log`` names (``mooncake_span.ops.cli_common``) while
Python's own logging and the commands' messages keep going to the real stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any


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
