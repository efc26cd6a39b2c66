"""How many tokens one storage key covers, learned however the sglang build hands it.

The four ways builds hand it: docs/operating.md, "sglang builds, page sizes
and K". The page may change until the first data call and is fixed from then
on, so K never changes under stored data.
"""

from __future__ import annotations

import enum
import logging
import numbers
import threading
from dataclasses import dataclass
from typing import Any

from mooncake_span.config import SpanOptions
from mooncake_span.errors import RegistrationError

logger = logging.getLogger(__name__)

STORAGE_PAGE_KEY = "storage_page_size"


class PageSource(enum.Enum):
    """Who named the storage page the backend runs with."""

    BUILD_CONFIG = "the build's HiCacheStorageConfig.storage_page_size"
    EXTRA_CONFIG = "extra-config storage_page_size"
    ASSIGNED = "storage_page_size assigned on the live backend by the build"
    TRANSFER = "the first transfer's host slots per key (the build named none)"
    UNDECLARED = "the host page (nothing named a storage page yet)"


@dataclass(frozen=True)
class PageChoice:
    """A storage page and its source; ``tokens`` None or 0 means the host page."""

    tokens: int | None
    source: PageSource

    def resolved(self, host_page_tokens: int) -> int:
        return self.tokens or host_page_tokens


def declared_page(storage_config: Any, options: SpanOptions) -> PageChoice:
    """What the build and the operator say at construction.

    The config's field wins when present, 0 included (0 = host page); without
    it the extra-config option applies; with neither the page is undeclared."""
    if hasattr(storage_config, STORAGE_PAGE_KEY):
        tokens = int(getattr(storage_config, STORAGE_PAGE_KEY) or 0) or None
        return PageChoice(tokens, PageSource.BUILD_CONFIG)
    if options.storage_page_size:
        return PageChoice(options.storage_page_size, PageSource.EXTRA_CONFIG)
    return PageChoice(None, PageSource.UNDECLARED)


def warn_if_inconsistent(storage_config: Any, options: SpanOptions, host_page_tokens: int) -> None:
    """One warning at registration when the extra-config value cannot be the
    controller's page (the stride rule would then turn every call into a miss)."""
    extra_tokens = options.storage_page_size or None
    if extra_tokens is None:
        return
    if hasattr(storage_config, STORAGE_PAGE_KEY):
        build_tokens = int(getattr(storage_config, STORAGE_PAGE_KEY) or 0) or host_page_tokens
        if extra_tokens != build_tokens:
            logger.warning(
                "mooncake-span: extra-config storage_page_size=%d is overridden by this sglang "
                "build's HiCacheStorageConfig.storage_page_size=%d (the controller's storage "
                "page); drop the extra-config key",
                extra_tokens,
                build_tokens,
            )
        return
    if extra_tokens != host_page_tokens:
        logger.warning(
            "mooncake-span: extra-config storage_page_size=%d differs from the %d-token host "
            "page, and this sglang build's HiCacheStorageConfig has no storage_page_size field. "
            "If its controller hashes one host page per key (stock sglang 0.5.23 does, also for "
            "GLM-5.3-Flash, whose page is forced to 256 tokens), every backup, hit query and "
            "prefetch fails the stride rule and L3 answers only misses. Remove storage_page_size "
            "unless this build's radix-tree page is %d tokens.",
            extra_tokens,
            host_page_tokens,
            extra_tokens,
        )


class StoragePage:
    """The storage page of one backend: open until the first data call, then fixed.

    Thread-safe: sglang's backup, prefetch and hit-query threads may make the
    first data call together; after it, ``settled`` is a plain read."""

    def __init__(self, declared: PageChoice) -> None:
        self.choice = declared
        self.settled = False
        # A hit query answered under the current page (it cannot tell the page).
        self.io_started = False
        self._lock = threading.Lock()
        self._reported: set[tuple[str, int]] = set()

    @property
    def open(self) -> bool:
        """True while a build may still hand another page (an operator's
        extra-config value is final: builds without the field cannot)."""
        return not self.settled and self.choice.source is not PageSource.EXTRA_CONFIG

    @property
    def derives(self) -> bool:
        """True while only a transfer can tell the page (the build named none)."""
        return self.choice.source is PageSource.UNDECLARED

    def assign(self, tokens: int, host_page_tokens: int | None) -> PageChoice | None:
        """The build assigns the page on the live backend. Returns the new choice
        when it changes the page, None when it does not; raises once data moved."""
        if tokens < 0:
            raise RegistrationError(
                f"{STORAGE_PAGE_KEY} must be >= 0 tokens (0 = host page), got {tokens}"
            )
        new = PageChoice(tokens or None, PageSource.ASSIGNED)
        with self._lock:
            if host_page_tokens is None:
                changed = new.tokens != self.choice.tokens
            else:
                changed = new.resolved(host_page_tokens) != self.choice.resolved(host_page_tokens)
            if self.settled or self.io_started:
                if changed:
                    current = self.choice.resolved(host_page_tokens or 0)
                    message = (
                        f"mooncake-span: refused {STORAGE_PAGE_KEY}={tokens} assigned after the "
                        f"first data call: the storage page stays {current} tokens (from "
                        f"{self.choice.source.value}), so K never changes under stored data; "
                        "a build must assign it before the first hit query, backup or prefetch"
                    )
                    logger.error("%s", message)
                    raise RegistrationError(message)
                return None
            self.choice = new
            return new if changed else None

    def settle(self, kv_slots_per_key: int | None, host_page_tokens: int) -> PageChoice | None:
        """Fix the page at a data call; ``kv_slots_per_key`` is the call's KV (or
        KV-derived) stride, None when it has none. Returns the new choice when a
        transfer named a page the build did not, else None."""
        with self._lock:
            if self.settled:
                return None
            self.settled = True
            if not self.derives or kv_slots_per_key in (None, host_page_tokens):
                return None
            if kv_slots_per_key < 1 or kv_slots_per_key % host_page_tokens:
                # Left at the host page: the stride rule refuses this transfer.
                return None
            self.choice = PageChoice(kv_slots_per_key, PageSource.TRANSFER)
            logger.info(
                "mooncake-span: storage page %d tokens (K=%d) learned from the first transfer; "
                "the build named none",
                kv_slots_per_key,
                kv_slots_per_key // host_page_tokens,
            )
            return self.choice

    def contradiction(self, pool_name: str, slots_per_key: int, host_page_tokens: int) -> None:
        """Log once per pool and stride that a transfer disagrees with the page."""
        key = (pool_name, slots_per_key)
        with self._lock:
            if key in self._reported:
                return
            self._reported.add(key)
        storage_tokens = self.choice.resolved(host_page_tokens)
        logger.error(
            "mooncake-span: pool %r sent %d host slots per key but the storage page is %d "
            "tokens (K=%d, from %s); every such transfer is a miss. The build and the backend "
            "disagree on the storage page: set it the way this build hands it "
            "(docs/operating.md, 'sglang builds, page sizes and K')",
            pool_name,
            slots_per_key,
            storage_tokens,
            storage_tokens // host_page_tokens,
            self.choice.source.value,
        )


def check_assignable(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RegistrationError(
            f"{STORAGE_PAGE_KEY} must be a whole number of tokens, got {value!r}"
        )
    return int(value)
