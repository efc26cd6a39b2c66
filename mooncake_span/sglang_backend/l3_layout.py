"""The router-facing L3 object layout (``describe_l3_object_layout``): sglang
MooncakeStore's fields plus the span geometry (``span.object_layout``) and
whether restores are verified against Mooncake's per-object checksums.
"""

from __future__ import annotations

import os
from typing import Any

from mooncake_span.config import SpanOptions
from mooncake_span.errors import ConfigError
from mooncake_span.sglang_backend.registration import Registration
from mooncake_span.span.object_layout import NamespaceFacts, describe_object_layout, pool_inputs
from mooncake_span.store.layout_guard import namespace_key
from mooncake_span.store.native import checksum_setting


def describe_layout(
    registration: Registration, storage_config: Any, options: SpanOptions
) -> dict[str, Any]:
    """The namespace's L3 object layout (see ``span.object_layout``)."""
    schema = registration.key_schema
    record = registration.geometry_record()
    pools = [registration.pools[name] for name in record.pools]
    layout = describe_object_layout(
        NamespaceFacts.from_schema(schema),
        pool_inputs(
            record.pools,
            {pool.name: pool.kind for pool in pools},
            {pool.name: tuple(c.scope.value for c in pool.components) for pool in pools},
        ),
        ranks=schema.ranks,
        is_mla=registration.is_mla,
        pp_rank=int(getattr(storage_config, "pp_rank", 0) or 0),
        pp_size=int(getattr(storage_config, "pp_size", 1) or 1),
        source="backend",
        layout_guard_key=namespace_key(schema.model, schema.tag),
    )
    layout["integrity"] = _integrity(options)
    return layout


def _integrity(options: SpanOptions) -> dict[str, Any]:
    """Whether restores are verified against Mooncake's per-object CRC-64, and why."""
    try:
        verify, source = checksum_setting(options, os.environ)
    except ConfigError as exc:  # the environment changed after setup
        return {"verify_checksums": None, "source": str(exc)}
    return {
        "verify_checksums": verify,
        "checksum": "crc64-ecma182" if verify else None,
        "source": source,
    }
