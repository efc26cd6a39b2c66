"""The store contract against ``FakeStore``: what entitles unit tests to use it.

The master address is a real listening socket of this test, so
``MooncakeClient.connect()`` runs its reachability probe unchanged.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import pytest

from mooncake_span.config import SpanOptions
from mooncake_span.errors import ErrorCode, SetupError, TransportError
from mooncake_span.mooncake_settings import MooncakeSettings
from mooncake_span.span.plan import ObjectPlan
from mooncake_span.store.client import MooncakeClient, NativeBinding, native_env_defaults
from mooncake_span_tools.testing.fake_store import FakeCluster, FakeReplicateConfig, FakeStore
from tests.contract.store_contract import StoreContract


class CountingFakeStore(FakeStore):
    """A FakeStore that remembers how often it was closed."""

    def __init__(self, cluster: FakeCluster) -> None:
        super().__init__(cluster)
        self.close_calls = 0

    def close(self) -> int:
        self.close_calls += 1
        return super().close()


@pytest.fixture
def listening_master() -> Iterator[str]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


class TestFakeStoreContract(StoreContract):
    @pytest.fixture
    def fake_cluster(self) -> FakeCluster:
        return FakeCluster(segments=("127.0.0.1:12001", "127.0.0.1:12002"))

    @pytest.fixture
    def placement_options(self) -> SpanOptions:
        return SpanOptions(master_admin_url="http://127.0.0.1:1")

    @pytest.fixture
    def make_client(self, listening_master, fake_cluster, monkeypatch):
        # connect() exports native defaults into os.environ when unset; pin
        # them through monkeypatch so they are restored after the test.
        for name, value in native_env_defaults(SpanOptions()).items():
            monkeypatch.setenv(name, os.environ.get(name, value))
        stores: list[CountingFakeStore] = []
        clients: list[MooncakeClient] = []

        def new_store() -> CountingFakeStore:
            store = CountingFakeStore(fake_cluster)
            stores.append(store)
            return store

        def factory(options: SpanOptions | None = None, *, fresh: bool = False) -> MooncakeClient:
            # Fake clients are cheap: every call gets its own, shared or not.
            settings = MooncakeSettings(
                master_server_address=listening_master,
                metadata_server="P2PHANDSHAKE",
                protocol="tcp",
                global_segment_size_bytes=0,
            )
            client = MooncakeClient(
                settings,
                options or SpanOptions(),
                NativeBinding(
                    new_store, FakeReplicateConfig, lambda url: fake_cluster.live_segments()
                ),
            )
            client.connect()
            clients.append(client)
            return client

        yield factory
        for client in clients:
            client.close()
        # Exactly once, even for clients a test closed itself.
        assert [s.close_calls for s in stores] == [1] * len(stores)

    # -- fake-only checks: the fake can show what the real store cannot --------

    def test_no_native_call_exceeds_the_buffer_budget(
        self, make_client, fake_cluster, key_namespace
    ):
        client = make_client(SpanOptions(max_buffers_per_call=8))
        keys = [f"{key_namespace}-{i}" for i in range(6)]
        self.put_objects(client, keys, 3, seed=1)
        target = self.arena(client, 6 * 3 * 4096)
        plans = [
            ObjectPlan([target.ctypes.data + (3 * i + j) * 4096 for j in range(3)], [4096] * 3)
            for i in range(6)
        ]
        fake_cluster.calls.clear()
        client.get(keys, plans)
        counts = [n for op, n in fake_cluster.calls if op == "batch_get_into_multi_buffers"]
        # 18 buffers in calls of at most 8 (two objects of 3 each) -> 3 calls.
        assert counts == [6, 6, 6]

    def test_duplicate_get_keys_are_split_into_rounds(
        self, make_client, fake_cluster, key_namespace
    ):
        client = make_client()
        key = f"{key_namespace}-x"
        self.put_objects(client, [key], 1, seed=2)
        fake_cluster.calls.clear()
        target = self.arena(client, 3 * 8192)
        value = next(iter(fake_cluster.objects.values()))
        plans = [ObjectPlan([target.ctypes.data + i * 8192], [len(value)]) for i in range(3)]
        assert client.get([key, key, key], plans) == [True, True, True]
        # One native call per occurrence: no call names the key twice.
        assert [op for op, _ in fake_cluster.calls] == ["batch_get_into_multi_buffers"] * 3

    def test_group_ids_reach_the_store(self, make_client, fake_cluster, key_namespace):
        client = make_client()
        arena = self.arena(client, 64, seed=3)
        key = f"{key_namespace}-g"
        assert client.put([key], [ObjectPlan([arena.ctypes.data], [64])], group_ids=["grp"]) == [
            True
        ]
        assert fake_cluster.groups[key] == "grp"

    def test_a_short_read_is_a_miss(self, make_client, fake_cluster, key_namespace):
        # Mooncake reports bytes read; anything but the planned size is a
        # failed read even though the code is not negative.
        client = make_client()
        key = f"{key_namespace}-short"
        self.put_objects(client, [key], 1, seed=4)
        size = len(fake_cluster.objects[key])
        target = self.arena(client, size)
        fake_cluster.inject("batch_get_into_multi_buffers", size - 1)
        assert client.get([key], [ObjectPlan([target.ctypes.data], [size])]) == [False]
        assert client.stats()["error_counts"].get("SHORT_READ") == 1
        # The next call is answered normally again.
        assert client.get([key], [ObjectPlan([target.ctypes.data], [size])]) == [True]

    @pytest.mark.parametrize("op", ["register_buffer", "get_size", "remove"])
    def test_single_key_calls_feed_counters_and_breaker(
        self, make_client, fake_cluster, key_namespace, op
    ):
        # These calls once bypassed the error accounting: a dead cluster seen
        # only through them never opened the breaker.
        client = make_client(SpanOptions(breaker_failures=2, breaker_probe_interval_s=60.0))
        arena = self.arena(client, 64, seed=5)
        key = f"{key_namespace}-one"
        calls = {
            "register_buffer": lambda: client.register_buffer(arena.ctypes.data, 64),
            "get_size": lambda: client.size_of(key),
            "remove": lambda: client.remove([key]),
        }
        fake_cluster.inject(op, int(ErrorCode.RPC_FAIL), times=2)
        for _ in range(2):
            with contextlib.suppress(SetupError):  # register_buffer's own error type
                calls[op]()
        stats = client.stats()
        assert stats["error_counts"]["RPC_FAIL"] == 2
        assert stats["breaker_state"] == "open"
        with pytest.raises(TransportError, match="breaker open"):
            calls[op]()
