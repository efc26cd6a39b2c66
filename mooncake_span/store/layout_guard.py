"""Cluster-wide layout guard: nodes sharing a key namespace must agree on geometry.

Every node publishes its namespace's geometry (model name + backend tag) and object
format, in Mooncake (``store``) or etcd; a node whose record differs refuses to start,
printing both sides. Why and the record: docs/span-format.md, "The layout guard's record".
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mooncake_span.errors import LayoutConflictError
from mooncake_span.span.keys import KEY_SCHEMA_VERSION, KeySchema, sanitize_token
from mooncake_span.span.plan import ObjectPlan
from mooncake_span.store.arena import StagingArena
from mooncake_span.store.seal import PLAIN_FORMAT, SEAL_FORMAT

if TYPE_CHECKING:
    from mooncake_span.config import SpanOptions
    from mooncake_span.store.client import MooncakeClient

logger = logging.getLogger(__name__)

RECORD_VERSION = 1


@dataclass(frozen=True)
class PoolGeometry:
    components: tuple[str, ...]
    bytes_per_page: tuple[int, ...]
    page_tokens: int


@dataclass(frozen=True)
class GeometryRecord:
    host_page_tokens: int
    storage_page_tokens: int
    layout: str
    kv_dtype: str
    pools: dict[str, PoolGeometry] = field(default_factory=dict)
    version: int = RECORD_VERSION
    object_format: str = PLAIN_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> GeometryRecord:
        raw = json.loads(text)
        pools = {
            name: PoolGeometry(
                tuple(p["components"]), tuple(p["bytes_per_page"]), int(p["page_tokens"])
            )
            for name, p in raw.get("pools", {}).items()
        }
        return cls(
            host_page_tokens=int(raw["host_page_tokens"]),
            storage_page_tokens=int(raw["storage_page_tokens"]),
            layout=str(raw["layout"]),
            kv_dtype=str(raw["kv_dtype"]),
            pools=pools,
            version=int(raw.get("version", RECORD_VERSION)),
            object_format=str(raw.get("object_format", PLAIN_FORMAT)),
        )

    def differences(self, other: GeometryRecord) -> list[str]:
        """Human-readable 'field: ours vs theirs' lines (empty when compatible)."""
        lines = []
        names = ("host_page_tokens", "storage_page_tokens", "layout", "kv_dtype", "object_format")
        for name in names:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                lines.append(f"{name}: this node {mine!r} vs published {theirs!r}")
        for pool in sorted(set(self.pools) & set(other.pools)):
            if self.pools[pool] != other.pools[pool]:
                lines.append(
                    f"pool {pool}: this node {asdict(self.pools[pool])} "
                    f"vs published {asdict(other.pools[pool])}"
                )
        return lines


def namespace_key(model: str, tag: str | None) -> str:
    parts = [KEY_SCHEMA_VERSION] + ([sanitize_token(tag)] if tag else []) + [sanitize_token(model)]
    return "_".join(parts) + "__geometry"


def check_or_publish(
    record: GeometryRecord,
    key: str,
    read: Callable[[str], str | None],
    create: Callable[[str, str], bool],
    *,
    page_open: bool = False,
) -> str:
    """Publish ``record`` under ``key`` unless another geometry is there: "published" or
    "matched"; LayoutConflictError otherwise. ``create`` is create-if-absent (False when
    the key exists). ``page_open``: this node's storage page may still change, so a
    record that differs only there is "deferred" (checked again once it is fixed).
    """
    ours = record.to_json()
    created = create(key, ours)
    published = read(key)
    if created and published in (None, ours):
        logger.info("mooncake-span layout guard: published geometry under %s", key)
        return "published"
    if published is None:
        raise LayoutConflictError(f"layout guard: {key} exists but cannot be read back")
    theirs = GeometryRecord.from_json(published)
    diffs = record.differences(theirs)
    if not diffs:
        logger.info("mooncake-span layout guard: geometry matches the published record %s", key)
        return "matched"
    if page_open and replace(theirs, storage_page_tokens=record.storage_page_tokens) == record:
        logger.info(
            "mooncake-span layout guard: %s holds a %d-token storage page; this node's page "
            "(%d tokens so far) is checked again once the build hands it",
            key,
            theirs.storage_page_tokens,
            record.storage_page_tokens,
        )
        return "deferred"
    raise LayoutConflictError(
        f"layout guard: this node's span geometry conflicts with the one published for "
        f"namespace {key}:\n  "
        + "\n  ".join(diffs)
        + "\nUse another model name or extra_backend_tag for this deployment, or make the "
        "nodes agree (same host page, storage_page_size, layout, dtype, model shape and "
        "span_object_checksums)."
    )


def check_layout_guard(
    options: SpanOptions,
    schema: KeySchema,
    record: GeometryRecord,
    client: MooncakeClient,
    arena: StagingArena,
    *,
    page_open: bool = False,
    previous: GeometryRecord | None = None,
) -> str:
    """Run the guard ``span_layout_guard`` selects: "off", or ``check_or_publish``'s
    answer for ``record`` with this node's ``object_format``. The ``store`` record moves
    through the registered staging ``arena``. ``previous``, a record published before the
    storage page was known, is withdrawn if still published."""
    mode = options.layout_guard
    if mode == "off":
        return "off"
    fmt = SEAL_FORMAT if options.object_checksums else PLAIN_FORMAT
    record = replace(record, object_format=fmt)
    key = namespace_key(schema.model, schema.tag)
    read, create, remove = _registry(mode, options, client, arena)
    if previous is not None and read(key) == replace(previous, object_format=fmt).to_json():
        remove(key)
        logger.info(
            "mooncake-span layout guard: withdrew the start-up record under %s (storage page "
            "%d tokens) for the page the build assigned (%d tokens)",
            key,
            previous.storage_page_tokens,
            record.storage_page_tokens,
        )
    return check_or_publish(record, key, read, create, page_open=page_open)


def create_text(client: MooncakeClient, arena: StagingArena, key: str, text: str) -> bool:
    """Store ``text`` under ``key`` unless the key exists; True if this call wrote it."""
    data = text.encode()
    if client.exists([key])[0]:
        return False
    with arena.lease(len(data), len(data)) as lease:
        ctypes.memmove(lease.ptr, data, len(data))
        plan = ObjectPlan([lease.ptr], [len(data)])
        # Unsealed: a record is read by its size, by any node whatever its options.
        return client.put([key], [plan], hard_pin=True, sealed=False)[0]


def read_text(client: MooncakeClient, arena: StagingArena, key: str) -> str | None:
    """The text stored under ``key``, or None when it cannot be read."""
    size = client.size_of(key)
    if size <= 0:
        return None
    with arena.lease(size, size) as lease:
        if not client.get([key], [ObjectPlan([lease.ptr], [size])], sealed=False)[0]:
            return None
        return ctypes.string_at(lease.ptr, size).decode()


def _registry(
    mode: str, options: SpanOptions, client: MooncakeClient, arena: StagingArena
) -> tuple[Callable[[str], str | None], Callable[[str, str], bool], Callable[[str], object]]:
    """read, create-if-absent and remove for the guard's record store (etcd through
    ``etcd3gw``, its HTTP gateway)."""
    if mode == "etcd":
        try:
            import etcd3gw
        except ImportError as exc:
            raise LayoutConflictError(
                "span_layout_guard='etcd' needs etcd3gw: pip install 'mooncake-span[etcd]'"
            ) from exc
        host, _, port = options.layout_guard_etcd.rpartition(":")
        etcd: Any = etcd3gw.client(host=host, port=int(port), timeout=5.0)

        def read_etcd(k: str) -> str | None:
            values = etcd.get(k)
            return values[0].decode() if values else None

        return read_etcd, lambda k, v: bool(etcd.create(k, v)), etcd.delete
    return (
        functools.partial(read_text, client, arena),
        functools.partial(create_text, client, arena),
        lambda k: client.remove([k]),
    )
