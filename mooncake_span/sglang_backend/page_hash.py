"""sglang's storage page hash, made ready while the server starts.

Why (a JIT-loaded extension whose first use would drop the first prefetch
after every start): docs/architecture.md, "How sglang 0.5.23 drives the
backend".
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

# A start-up cost this large is worth a line in the server's log.
_REPORT_LOAD_S = 0.5


def preload_page_hash(page_tokens: int) -> bool:
    """Hash one page the way the controller will; False (logged) if that failed.

    A failure here is not fatal: the controller would hit the same error at its
    first hit query and handle it there, as it does without this backend."""
    started = time.monotonic()
    try:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        get_storage_hash_str(list(range(page_tokens)), None, page_size=page_tokens)
    except Exception:  # noqa: BLE001 - any failure leaves the lazy load to sglang
        logger.warning(
            "mooncake-span: could not load sglang's page-hash function at start-up; the "
            "first hit query will load it, and a timeout prefetch policy may drop that prefetch",
            exc_info=True,
        )
        return False
    elapsed_s = time.monotonic() - started
    if elapsed_s >= _REPORT_LOAD_S:
        logger.info(
            "mooncake-span: loaded sglang's page-hash extension in %.1fs at start-up "
            "(otherwise the first restore after a start would pay it)",
            elapsed_s,
        )
    return True
