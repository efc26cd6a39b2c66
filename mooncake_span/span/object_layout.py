"""Router-facing description of the L3 object layout. Pure: dicts and ints only.

sglang's ``MooncakeStore.describe_l3_object_layout`` fields plus a ``span``
section; built by the backend and by ``mooncake-span inspect`` (which lacks rank
scopes), unknown facts ``None``: docs/operating.md, "L3 object-layout description".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_span.span.geometry import PoolKind

# The reverse of the prefix's layout codes; keys.py owns the table.
from mooncake_span.span.keys import _LAYOUT_CODES as LAYOUT_CODES
from mooncake_span.span.keys import KEY_SCHEMA_VERSION, KeySchema, RankTags, sanitize_token

PREFIX_GRAMMAR = f"{KEY_SCHEMA_VERSION}[_{{tag}}]_{{model}}_h{{host_page_tokens}}x{{pages_per_span}}_{{layout_code}}_{{kv_dtype}}"  # noqa: E501
# Pools whose hit is decided by their last pages only (sglang's default windows).
_TRAILING_PAGES = {"mamba": 1}
_GEOMETRY_TOKEN = re.compile(r"h([0-9]+)x([0-9]+)")


@dataclass(frozen=True)
class NamespaceFacts:
    """What identifies one deployment's objects in the cluster."""

    key_prefix: str
    model: str
    tag: str | None
    host_page_tokens: int
    pages_per_span: int
    layout: str
    kv_dtype: str

    @classmethod
    def from_schema(cls, schema: KeySchema) -> NamespaceFacts:
        return cls(
            key_prefix=schema.prefix,
            model=sanitize_token(schema.model),
            tag=sanitize_token(schema.tag) if schema.tag else None,
            host_page_tokens=schema.host_page_tokens,
            pages_per_span=schema.pages_per_span,
            layout=schema.layout,
            kv_dtype=sanitize_token(schema.kv_dtype),
        )


def _describe_pool(
    name: str,
    shape: Any,
    kind: PoolKind,
    scopes: Mapping[str, tuple[str, ...]] | None,
    ranks: RankTags | None,
    storage_page_tokens: int,
) -> dict[str, object]:
    pages_per_key = None  # state pools store a window that sglang picks per transfer
    if kind is not PoolKind.STATE and shape.page_tokens > 0:
        pages_per_key = max(1, storage_page_tokens // shape.page_tokens)
    pool_scopes = None if scopes is None else scopes.get(name)
    components = []
    for i, component in enumerate(shape.components):
        scope = pool_scopes[i] if pool_scopes is not None else None
        rank = None
        if ranks is not None and scope is not None:
            rank = ranks.replicated if scope == "replicated" else ranks.sharded
        page_bytes = shape.bytes_per_page[i] if i < len(shape.bytes_per_page) else None
        components.append(
            {
                "name": component,
                "rank_scope": scope,
                "suffix": None if rank is None else f"_{rank}_{component}",
                "bytes_per_pool_page": page_bytes,
                "bytes_per_object": (
                    None
                    if pages_per_key is None or page_bytes is None
                    else page_bytes * pages_per_key
                ),
            }
        )
    sizes = [c["bytes_per_object"] for c in components]
    trailing = _TRAILING_PAGES.get(name)
    entry: dict[str, object] = {
        "pool": name,
        "kind": kind.value,
        "suffixes": [c["suffix"] for c in components],
        "hit_policy": "trailing_pages" if trailing else "all_pages",
        "pool_page_tokens": shape.page_tokens,
        "pool_pages_per_key": pages_per_key,
        "components": components,
        "bytes_per_key": None if None in sizes else sum(sizes),  # type: ignore[arg-type]
    }
    if trailing:
        entry["trailing_pages"] = trailing
    return entry


def describe_object_layout(
    facts: NamespaceFacts,
    pools: Mapping[str, Any],
    kinds: Mapping[str, PoolKind],
    *,
    scopes: Mapping[str, tuple[str, ...]] | None = None,
    ranks: RankTags | None = None,
    is_mla: bool | None = None,
    pp_rank: int | None = None,
    pp_size: int | None = None,
    source: str = "backend",
    layout_guard_key: str | None = None,
) -> dict[str, object]:
    """The layout document (JSON-ready) of ``pools``, layout-guard pool shapes by name
    (``components``, ``bytes_per_page`` per pool page and component, ``page_tokens``);
    ``scopes``: each component's rank scope, unknown (None) to a guard record.
    ``source`` says who built it."""
    storage_page_tokens = facts.host_page_tokens * facts.pages_per_span
    described = [
        _describe_pool(name, shape, kinds[name], scopes, ranks, storage_page_tokens)
        for name, shape in pools.items()
    ]
    # The KV anchor first, as upstream lists it.
    described.sort(key=lambda p: (p["kind"] != PoolKind.KV_ANCHOR.value, p["pool"]))
    key_sizes = [p["bytes_per_key"] for p in described]
    return {
        "enabled": True,
        "backend": "mooncake-span",
        # sglang hands the backend one page key per storage page.
        "page_size": storage_page_tokens,
        "hicache_object_layout": {
            "pools": described,
            "key_prefix": facts.key_prefix,
            "is_mla_backend": is_mla,
            "pp_rank": pp_rank,
            "pp_size": pp_size,
        },
        "span": {
            "layout_version": 1,
            "source": source,
            "namespace": facts.key_prefix,
            "model": facts.model,
            "tag": facts.tag,
            "pages_per_span": facts.pages_per_span,
            "host_page_tokens": facts.host_page_tokens,
            "storage_page_tokens": storage_page_tokens,
            "host_layout": facts.layout,
            "kv_dtype": facts.kv_dtype,
            "key_schema_version": KEY_SCHEMA_VERSION,
            "key_grammar": "{key_prefix}_{page_key}_{rank}_{component}",
            "key_prefix_grammar": PREFIX_GRAMMAR,
            "rank_suffixes": (
                None
                if ranks is None
                else {"replicated": ranks.replicated, "sharded": ranks.sharded}
            ),
            "layout_guard_key": layout_guard_key,
            "bytes_per_key": None if None in key_sizes else sum(key_sizes),  # type: ignore[arg-type]
        },
    }


_LAYOUT_NAMES = {code: name for name, code in LAYOUT_CODES.items()}
GEOMETRY_SUFFIX = "__geometry"


def parse_object_key(key: str) -> tuple[NamespaceFacts, str] | None:
    """A mooncake-span object key split along the grammar: its namespace and the rest,
    ``{page_key}_{rank}_{component}``; None for any other key (foreign, guard record).
    Prefix fields are sanitized tokens without ``_``, so the split is exact."""
    parts = key.split("_")
    if parts[0] != KEY_SCHEMA_VERSION:
        return None
    for geometry_at in (2, 3):
        match = _GEOMETRY_TOKEN.fullmatch(parts[geometry_at]) if len(parts) > geometry_at else None
        if match is not None:
            break
    else:
        return None
    if len(parts) < geometry_at + 3 or not all(parts[1 : geometry_at + 3]):
        return None
    prefix = "_".join(parts[: geometry_at + 3])
    facts = NamespaceFacts(
        key_prefix=prefix,
        model=parts[geometry_at - 1],
        tag=parts[1] if geometry_at == 3 else None,
        host_page_tokens=int(match.group(1)),
        pages_per_span=int(match.group(2)),
        layout=_LAYOUT_NAMES.get(parts[geometry_at + 1], parts[geometry_at + 1]),
        kv_dtype=parts[geometry_at + 2],
    )
    return facts, key[len(prefix) + 1 :]


def parse_guard_key(key: str) -> tuple[str | None, str] | None:
    """``(tag, model)`` of a layout-guard record key ``ms2[_{tag}]_{model}__geometry``."""
    if not key.startswith(KEY_SCHEMA_VERSION + "_") or not key.endswith(GEOMETRY_SUFFIX):
        return None
    body = key[len(KEY_SCHEMA_VERSION) + 1 : -len(GEOMETRY_SUFFIX)]
    parts = body.split("_")
    if len(parts) == 1 and parts[0]:
        return None, parts[0]
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1]
    return None
