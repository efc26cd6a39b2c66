"""How every benchmark builds a contender: our backend or sglang's upstream MooncakeStore.

Both are built the way sglang builds them (a ``HiCacheStorageConfig``, the
host pools registered as the controller registers them) and both talk to the
native client the harness hands over, so a comparison differs in the adapter
and in nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from unittest import mock

from mooncake_span_tools.testing import pools as P

# Pools as the controller registers them: the KV anchor first, then every pool by name.
HostPools = Mapping[Any, Any]


def storage_config(
    extra: Mapping[str, Any], name: str, *, is_mla: bool = True, metrics: bool = False
) -> Any:
    """The one-rank config sglang's controller would hand a backend. Storage metrics
    are off unless asked for: a benchmark reads its own counters."""
    return P.single_rank_storage_config(
        extra, model_name=name, is_mla=is_mla, enable_storage_metrics=metrics
    )


def register_pools(store: Any, pools: HostPools) -> None:
    """sglang's order: ``register_mem_pool_host`` with the KV pool, then every
    pool (KV included) through ``register_mem_host_pool_v2``."""
    store.register_mem_pool_host(pools[P.PoolName.KV])
    for name, pool in pools.items():
        store.register_mem_host_pool_v2(pool, name)


def span_backend(
    config: Any,
    pools: HostPools,
    native: Any = None,
    *,
    replicate_config: Callable[[], Any] | None = None,
    list_segments: Callable[[str], list[str]] | None = None,
    binding: Any = None,
) -> Any:
    """``MooncakeSpanStore`` on ``pools``, registered and layout-checked.

    ``native``: a client the harness owns (shared, timed or recording), used in
    place of one the backend would create; ``binding``: a whole binding
    instead; neither: the backend makes its own client, as in a server.
    """
    from mooncake_span.sglang_backend.backend import MooncakeSpanStore

    if native is not None:
        from mooncake_span.store.client import NativeBinding

        if replicate_config is None:
            from mooncake.store import ReplicateConfig

            replicate_config = ReplicateConfig
        extra = () if list_segments is None else (list_segments,)
        binding = NativeBinding(lambda: native, replicate_config, *extra)
    store = (
        MooncakeSpanStore(config, {}, binding=binding)
        if binding is not None
        else MooncakeSpanStore(config, {})
    )
    register_pools(store, pools)
    store.on_host_pools_registered()
    return store


def upstream_backend(config: Any, pools: HostPools, native: Any) -> Any:
    """sglang's own ``MooncakeStore``, constructed as sglang constructs it; only
    the native client it creates is ``native``."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    with mock.patch.object(MooncakeStore, "_import_mooncake_store", lambda _self: lambda: native):
        store = MooncakeStore(config, pools[P.PoolName.KV])
    register_pools(store, pools)
    return store
