"""Span geometry and the per-pool stride rules. Pure: integers and strings only.

One storage key covers ``pages_per_span`` (K) host pages. Host slots per key are
derived per transfer (``numel // len(keys)``), never predicted: docs/span-format.md,
"Derived strides". The prefetch path rebuilds KV-derived transfers without
``indices_from_pool``, hence the name table below.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mooncake_span.errors import InvalidRequestError, RegistrationError

KV_POOL = "kv"

# Pools whose host indices are the KV anchor's token slots (sglang PoolName
# values). *_STATE pools take their indices from SWA and are not listed.
KV_DERIVED_POOLS = frozenset(
    {
        "indexer",
        "draft",
        "draft_indexer",
        "deepseek_v4_c1",
        "deepseek_v4_c1_indexer",
        "deepseek_v4_c1_indexer_scale",
        "deepseek_v4_c2",
        "deepseek_v4_c2_indexer",
        "deepseek_v4_c2_indexer_scale",
        "deepseek_v4_c4",
        "deepseek_v4_c4_indexer",
        "deepseek_v4_c4_indexer_scale",
        "deepseek_v4_c4_rope",
        "deepseek_v4_c128",
        "deepseek_v4_c128_rope",
    }
)


class PoolKind(enum.Enum):
    KV_ANCHOR = "kv_anchor"
    KV_DERIVED = "kv_derived"
    STATE = "state"


def classify_pool(name: str, learned_kv_derived: frozenset[str] = frozenset()) -> PoolKind:
    if name == KV_POOL:
        return PoolKind.KV_ANCHOR
    if name in KV_DERIVED_POOLS or name in learned_kv_derived:
        return PoolKind.KV_DERIVED
    return PoolKind.STATE


@dataclass(frozen=True)
class SpanGeometry:
    """How many tokens one storage key covers, relative to the anchor's host page."""

    host_page_tokens: int
    storage_page_tokens: int

    def __post_init__(self) -> None:
        if self.host_page_tokens < 1:
            raise RegistrationError(
                f"host page size must be >= 1 token, got {self.host_page_tokens}"
            )
        if self.storage_page_tokens < 1 or self.storage_page_tokens % self.host_page_tokens:
            raise RegistrationError(
                f"storage_page_size ({self.storage_page_tokens} tokens) must be a positive "
                f"multiple of the host page size ({self.host_page_tokens} tokens)"
            )

    @property
    def pages_per_span(self) -> int:
        return self.storage_page_tokens // self.host_page_tokens

    @classmethod
    def resolve(cls, host_page_tokens: int, *candidates: int | None) -> SpanGeometry:
        """Take the first positive candidate as the storage page; 0/None mean "host page"."""
        for value in candidates:
            if value:
                return cls(host_page_tokens, int(value))
        return cls(host_page_tokens, host_page_tokens)

    def check_pool_page(self, pool_name: str, pool_page_tokens: int) -> None:
        """A KV-derived pool's page must tile the storage page exactly."""
        if pool_page_tokens < 1 or self.storage_page_tokens % pool_page_tokens:
            raise RegistrationError(
                f"storage_page_size ({self.storage_page_tokens} tokens) must be a multiple of "
                f"pool {pool_name!r}'s page size ({pool_page_tokens} tokens)"
            )


def derive_slots_per_key(
    *,
    pool_name: str,
    kind: PoolKind,
    num_slots: int,
    num_keys: int,
    pool_page_tokens: int,
    storage_page_tokens: int,
) -> int:
    """Host slots per key for one transfer, or InvalidRequestError naming what is wrong."""
    if num_keys < 1:
        raise InvalidRequestError(f"pool {pool_name!r}: transfer has no keys")
    if pool_page_tokens < 1:
        raise InvalidRequestError(
            f"pool {pool_name!r}: page size must be >= 1 slot, got {pool_page_tokens}"
        )
    if num_slots < 1 or num_slots % num_keys:
        raise InvalidRequestError(
            f"pool {pool_name!r}: {num_slots} host indices do not divide evenly "
            f"among {num_keys} keys"
        )
    slots_per_key = num_slots // num_keys
    if kind is not PoolKind.STATE and slots_per_key != storage_page_tokens:
        raise InvalidRequestError(
            f"pool {pool_name!r} ({kind.value}): expected {storage_page_tokens} host slots "
            f"per key (storage page), got {slots_per_key} ({num_slots} indices / {num_keys} keys)"
        )
    if slots_per_key % pool_page_tokens:
        raise InvalidRequestError(
            f"pool {pool_name!r}: {slots_per_key} host slots per key is not a whole number "
            f"of {pool_page_tokens}-slot pool pages"
        )
    return slots_per_key
