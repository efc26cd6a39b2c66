"""The store contract against a real Mooncake cluster (the session fixture).

Same cases as tests/unit/test_fake_store_contract.py; a case that passes there
and fails here means FakeStore no longer models Mooncake.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from mooncake_span.config import SpanOptions
from mooncake_span.mooncake_settings import MooncakeSettings
from mooncake_span.store.client import MooncakeClient, native_env_defaults
from tests.contract.store_contract import StoreContract

pytestmark = pytest.mark.integration


class _ClientPool:
    """Connected clients of one cluster, shared per SpanOptions within a class.

    A native close() takes about a second, so one client per test would cost
    more than the tests themselves.
    """

    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings
        self.shared: dict[SpanOptions, MooncakeClient] = {}
        self.all: list[MooncakeClient] = []

    def get(self, options: SpanOptions | None = None, *, fresh: bool = False) -> MooncakeClient:
        options = options or SpanOptions()
        cached = self.shared.get(options)
        if not fresh and cached is not None and not cached.closed:
            return cached
        client = MooncakeClient(self.settings, options)
        client.connect()
        self.all.append(client)
        if not fresh:
            self.shared[options] = client
        return client

    def remove_prefix(self, prefix: str) -> None:
        for client in self.all:
            if not client.closed:
                client.remove_prefix(prefix)
                return

    def close_all(self) -> None:
        for client in self.all:
            # Idempotent: a client the test closed is not closed natively again.
            client.close()


class TestRealStoreContract(StoreContract):
    @pytest.fixture(scope="class")
    def _client_pool(self, mooncake_cluster) -> Iterator[_ClientPool]:
        with pytest.MonkeyPatch.context() as mp:
            # Neither the cluster's client environment nor connect()'s native
            # defaults may leak into later tests.
            for name, value in mooncake_cluster.client_env().items():
                mp.setenv(name, os.environ.get(name, value))
            for name, value in native_env_defaults(SpanOptions()).items():
                mp.setenv(name, os.environ.get(name, value))
            config = mooncake_cluster.client_config()
            pool = _ClientPool(
                MooncakeSettings(
                    master_server_address=str(config["master_server_address"]),
                    metadata_server=str(config["metadata_server"]),
                    protocol="tcp",
                    local_hostname=str(config["local_hostname"]),
                    global_segment_size_bytes=0,
                )
            )
            try:
                yield pool
            finally:
                pool.close_all()

    @pytest.fixture
    def placement_options(self, mooncake_cluster) -> SpanOptions:
        url = getattr(mooncake_cluster, "metrics_url", None)
        if url is None:
            pytest.skip("an external cluster does not say where its master's admin server is")
        return SpanOptions(master_admin_url=url)

    @pytest.fixture
    def make_client(self, _client_pool, key_namespace):
        yield _client_pool.get
        # Leave the shared cluster as we found it.
        _client_pool.remove_prefix(key_namespace)
