"""Fixtures that build MooncakeSpanStore instances on the session cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.span_helpers import make_storage_config, register_pools


@pytest.fixture
def span_store_factory(mooncake_cluster: Any, key_namespace: str) -> Iterator[Callable[..., Any]]:
    """``factory(pools, *, storage_page_size, is_mla=True, binding=None, **extra)`` ->
    registered store (``binding``: the native store class, e.g. a checking proxy).

    ``pools`` maps sglang PoolName -> host pool; KV is the anchor. The model
    name is the test's key namespace, so tests never see each other's objects.
    Every store is closed after the test.
    """
    from mooncake_span.sglang_backend import MooncakeSpanStore

    stores: list[Any] = []

    def factory(
        pools: dict[Any, Any],
        *,
        storage_page_size: int | None = None,
        is_mla: bool = True,
        model_name: str | None = None,
        tp_rank: int = 0,
        binding: Any = None,
        **extra: Any,
    ) -> Any:
        config = mooncake_cluster.client_config()
        if storage_page_size is not None:
            config["storage_page_size"] = storage_page_size
        config.update(extra)
        store = MooncakeSpanStore(
            make_storage_config(
                config, is_mla=is_mla, model_name=model_name or key_namespace, tp_rank=tp_rank
            ),
            {},
            binding=binding,
        )
        stores.append(store)
        register_pools(store, pools)
        return store

    yield factory
    for store in stores:
        store.close()
