"""Where the backend learns how many tokens one storage key covers.

Span-aware sglang builds put ``storage_page_size`` on ``HiCacheStorageConfig``
and their controller hashes and slices host indices by it, so that field is
the truth when it exists. Stock sglang 0.5.23 has no such field: its
controller hashes one host page per key, and the extra-config
``storage_page_size`` is the only way to run span mode (a build whose tree
page is wider than the host page but whose config does not carry it). The
backend cannot see the controller's page, so a mismatch there stays a
warning: refusing would break those builds, and the stride rule still turns
each wrong call into a logged miss, never wrong bytes.
"""

from __future__ import annotations

import logging
from typing import Any

from mooncake_span.config import SpanOptions

logger = logging.getLogger(__name__)

STORAGE_PAGE_KEY = "storage_page_size"


def resolve_storage_page_tokens(
    storage_config: Any, options: SpanOptions, host_page_tokens: int
) -> int | None:
    """Tokens per storage key, or None for "the host page" (K=1).

    When the config carries the field it wins, 0 included (0 = host page);
    otherwise the extra-config option applies. Logs one warning when the
    extra-config value cannot be what the controller uses.
    """
    extra_tokens = options.storage_page_size or None
    if hasattr(storage_config, STORAGE_PAGE_KEY):
        build_tokens = int(getattr(storage_config, STORAGE_PAGE_KEY) or 0) or None
        if extra_tokens is not None and extra_tokens != (build_tokens or host_page_tokens):
            logger.warning(
                "mooncake-span: extra-config %s=%d is overridden by this sglang build's "
                "HiCacheStorageConfig.%s=%d (the controller's storage page); drop the "
                "extra-config key",
                STORAGE_PAGE_KEY,
                extra_tokens,
                STORAGE_PAGE_KEY,
                build_tokens or host_page_tokens,
            )
        return build_tokens
    if extra_tokens is not None and extra_tokens != host_page_tokens:
        logger.warning(
            "mooncake-span: extra-config %s=%d differs from the %d-token host page, and this "
            "sglang build's HiCacheStorageConfig has no %s field. If its controller hashes "
            "one host page per key (stock sglang 0.5.23 does, also for GLM-5.3-Flash, whose "
            "page is forced to 256 tokens), every backup, hit query and prefetch fails the "
            "stride rule and L3 answers only misses. Remove %s unless this build's radix-tree "
            "page is %d tokens.",
            STORAGE_PAGE_KEY,
            extra_tokens,
            host_page_tokens,
            STORAGE_PAGE_KEY,
            STORAGE_PAGE_KEY,
            extra_tokens,
        )
    return extra_tokens
