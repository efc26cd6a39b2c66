"""sglang plugin (entry point group ``sglang.srt.plugins``).

With ``MOONCAKE_SPAN_SERVE_MOONCAKE=1``, ``--hicache-storage-backend mooncake``
is served by ``MooncakeSpanStore``; otherwise nothing changes. Why this path
matters for span-aware builds: docs/architecture.md, "How sglang 0.5.23 drives
the backend".
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

OPT_IN_ENV = "MOONCAKE_SPAN_SERVE_MOONCAKE"
BACKEND_NAME = "mooncake"
MODULE_PATH = "mooncake_span.sglang_backend"
CLASS_NAME = "MooncakeSpanStore"


def opted_in(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(OPT_IN_ENV, "")
    if value.strip().lower() in ("", "0", "false", "no", "off"):
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{OPT_IN_ENV} must be 1/0 or true/false, got {value!r}")


def register() -> None:
    """Entry point: map the ``mooncake`` backend name to MooncakeSpanStore when opted in."""
    if not opted_in():
        logger.debug("%s not set; sglang's built-in mooncake backend stays in place", OPT_IN_ENV)
        return
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    StorageBackendFactory.register_backend(BACKEND_NAME, MODULE_PATH, CLASS_NAME)
    logger.info(
        "mooncake-span serves --hicache-storage-backend %s (%s.%s)",
        BACKEND_NAME,
        MODULE_PATH,
        CLASS_NAME,
    )
