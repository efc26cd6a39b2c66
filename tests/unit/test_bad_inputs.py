"""The bad-input table: every malformed call gets a clear error (logged, naming
the pool / key / sizes) or per-key False, and nothing already stored changes.

Runs on the in-memory FakeStore (held to the real client's behaviour by
tests/contract) with real sglang host pools. Rows marked ``config`` fail at
construction or registration instead, with an exception naming the problem.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from mooncake_span.errors import ConfigError, RegistrationError, SetupError
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import FAKE_CLIENT, make_storage_config, slots_of

PAGE = 64
SPAN = 4 * PAGE


@pytest.fixture(scope="module")
def pool_set():
    return P.build_compressed_hybrid_dsa("page_first", host_pages=16, mamba_slots=6)


@pytest.fixture
def rig(pool_set, make_backend):
    """A registered store on a fake cluster holding two good keys."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    cluster = FakeCluster()
    config = {**FAKE_CLIENT, "storage_page_size": SPAN}
    store = make_backend(config, pool_set.pools, cluster=cluster)
    kv = pool_set[PoolName.KV]
    P.fill_random_pages(kv, [p * PAGE for p in range(8)], seed=5)
    good = slots_of(list(range(8)), PAGE)
    assert store.batch_set_v2(
        [
            PoolTransfer(
                PoolName.INDEXER,
                host_indices=good,
                keys=["g0", "g1"],
                indices_from_pool=PoolName.KV,
            ),
            PoolTransfer(
                PoolName.MAMBA,
                host_indices=torch.tensor([1]),
                keys=["g1"],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]
    ) == {PoolName.INDEXER: [True, True], PoolName.MAMBA: [True]}
    assert store.batch_set_v1(["g0", "g1"], good) == [True, True]
    return store, cluster, good


@dataclass(frozen=True)
class Row:
    name: str
    call: Callable[[Any, torch.Tensor], Any]
    expect: Any
    log: str  # substring the logged error must contain


def _t(*args, **kwargs):
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    return PoolTransfer(*args, **kwargs)


def _n():
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

    return PoolName, PoolHitPolicy


ROWS = [
    Row(
        "v1 indices not divisible among keys",
        lambda s, g: s.batch_set_v1(["a", "b"], g[:301]),
        [False, False],
        "301 host indices do not divide evenly among 2 keys",
    ),
    Row(
        "v1 KV stride != storage page",
        lambda s, g: s.batch_set_v1(["a", "b", "c", "d"], g),
        [False] * 4,
        "expected 256 host slots per key",
    ),
    Row(
        "v2 KV-derived pool with wrong stride",
        lambda s, g: s.batch_set_v2([_t(_n()[0].INDEXER, host_indices=g[:128], keys=["a"])]),
        {"indexer": [False]},
        "expected 256 host slots per key",
    ),
    Row(
        "v2 state pool stride not divisible",
        lambda s, g: s.batch_set_v2(
            [_t(_n()[0].MAMBA, host_indices=torch.tensor([1, 2, 3]), keys=["a", "b"])]
        ),
        {"mamba": [False, False]},
        "3 host indices do not divide evenly among 2 keys",
    ),
    Row(
        "v2 unregistered pool",
        lambda s, g: s.batch_set_v2([_t(_n()[0].SWA, host_indices=g, keys=["a", "b"])]),
        {"swa": [False, False]},
        "names unregistered pool 'swa'",
    ),
    Row(
        "v1 host index out of range",
        lambda s, g: s.batch_get_v1(["a"], torch.arange(100 * PAGE, 104 * PAGE)),
        [False],
        "host page out of range",
    ),
    Row(
        "v1 negative host indices",
        lambda s, g: s.batch_get_v1(["a"], torch.arange(-4 * PAGE, 0)),
        [False],
        "host page out of range",
    ),
    Row(
        "v1 indices not page aligned",
        lambda s, g: s.batch_set_v1(["a"], torch.arange(1, 1 + SPAN)),
        [False],
        "not whole 64-slot host pages",
    ),
    Row(
        "v1 indices not contiguous within a page",
        lambda s, g: s.batch_set_v1(["a"], torch.arange(SPAN).flip(0)),
        [False],
        "not whole 64-slot host pages",
    ),
    Row(
        "v1 float indices",
        lambda s, g: s.batch_set_v1(["a"], g[:SPAN].float()),
        [False],
        "host_indices must be integers",
    ),
    Row(
        "v1 indices on another device",
        lambda s, g: s.batch_set_v1(["a"], torch.empty(SPAN, device="meta", dtype=torch.int64)),
        [False],
        "must be on the CPU",
    ),
    Row(
        "v1 indices not a tensor",
        lambda s, g: s.batch_set_v1(["a"], list(range(SPAN))),
        [False],
        "host_indices must be a tensor",
    ),
    Row(
        "v1 host_indices None",
        lambda s, g: s.batch_get_v1(["a"], None),
        [False],
        "host_indices is None",
    ),
    Row("v1 empty key list", lambda s, g: s.batch_set_v1([], g[:0]), [], "transfer has no keys"),
    Row("v1 keys None", lambda s, g: s.batch_get_v1(None, g[:SPAN]), [], "keys is None"),
    Row(
        "v2 transfer keys None",
        lambda s, g: s.batch_set_v2([_t(_n()[0].INDEXER, host_indices=g[:SPAN], keys=None)]),
        {"indexer": []},
        "keys is None",
    ),
    Row(
        "empty-string key",
        lambda s, g: s.batch_set_v1([""], g[:SPAN]),
        [False],
        "key #0 must be a non-empty str",
    ),
    Row(
        "key with whitespace",
        lambda s, g: s.batch_set_v1(["a b"], g[:SPAN]),
        [False],
        "whitespace or control characters",
    ),
    Row(
        "key with control character",
        lambda s, g: s.batch_set_v1(["a\x00b"], g[:SPAN]),
        [False],
        "whitespace or control characters",
    ),
    Row(
        "very long key",
        lambda s, g: s.batch_set_v1(["x" * 600], g[:SPAN]),
        [False],
        "600 chars long",
    ),
    Row(
        "non-str key",
        lambda s, g: s.batch_set_v1([17], g[:SPAN]),
        [False],
        "key #0 must be a non-empty str",
    ),
    Row(
        "v2 host_indices None",
        lambda s, g: s.batch_get_v2([_t(_n()[0].INDEXER, host_indices=None, keys=["a"])]),
        {"indexer": [False]},
        "host_indices is None",
    ),
    Row("v2 transfers not a list", lambda s, g: s.batch_get_v2(42), {}, "transfers must be a list"),
    Row(
        "exists_v2 unregistered pool",
        lambda s, g: _hit(s.batch_exists_v2(["g0", "g1"], [_t(_n()[0].SWA, keys=["x"])])),
        (0, []),
        "unregistered pool 'swa'",
    ),
    Row(
        "exists_v2 unknown hit policy",
        lambda s, g: _hit(
            s.batch_exists_v2(["g0"], [_t(_n()[0].INDEXER, keys=None, hit_policy="sometimes")])
        ),
        (0, []),
        "unsupported hit policy",
    ),
    Row(
        "generic batch_set wrong tensor size",
        lambda s, g: s.batch_set(["a"], [torch.zeros(10, dtype=torch.uint8)]),
        False,
        "storage page is",
    ),
    Row(
        "generic batch_get key/tensor count mismatch",
        lambda s, g: s.batch_get(["a", "b"], [torch.zeros(10, dtype=torch.uint8)]),
        [None, None],
        "2 keys but 1 tensors",
    ),
]


def _hit(result):
    return (result.kv_hit_pages, result.restorable_prefix_pages)


def _normalise(result):
    if isinstance(result, dict):
        return {str(getattr(k, "value", k)): v for k, v in result.items()}
    return result


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_row(rig, row, caplog):
    store, cluster, good = rig
    before = dict(cluster.objects)
    with caplog.at_level(logging.ERROR, logger="mooncake_span"):
        result = row.call(store, good)
    assert _normalise(result) == row.expect
    assert row.log in caplog.text, (
        f"expected a log naming the problem ({row.log!r}), got:\n{caplog.text}"
    )
    assert cluster.objects == before, "a rejected call changed what is stored"
    # and the good keys still restore
    assert store.batch_exists(["g0", "g1"]) == 2
    assert store.batch_get_v1(["g0", "g1"], good) == [True, True]


def test_duplicate_keys_in_one_set_store_once(rig):
    store, cluster, good = rig
    before = len(cluster.objects)
    assert store.batch_set_v1(["dup", "dup"], good) == [True, True]
    assert len(cluster.objects) == before + 1


def test_calls_before_registration_answer_misses(make_backend, caplog):
    store = make_backend(FAKE_CLIENT)
    with caplog.at_level(logging.ERROR, logger="mooncake_span"):
        assert store.batch_get_v1(["a"], torch.arange(PAGE)) == [False]
        assert store.batch_exists(["a"]) == 0
        assert store.batch_get_v2([]) == {}
        assert _hit(store.batch_exists_v2(["a"], [])) == (0, [])
    assert "no host pool registered yet" in caplog.text


def test_calls_after_close_answer_misses(rig, caplog):
    store, cluster, good = rig
    store.close()
    with caplog.at_level(logging.ERROR, logger="mooncake_span"):
        assert store.batch_get_v1(["g0"], good[:SPAN]) == [False]
        assert store.batch_set_v1(["n"], good[:SPAN]) == [False]
        assert store.batch_exists(["g0"]) == 0
    assert "after close()" in caplog.text


def test_storage_page_not_multiple_of_host_page(make_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    store = make_backend({**FAKE_CLIENT, "storage_page_size": 100})
    kv = P.build_mla_host("page_first", layers=1, host_pages=2)
    with pytest.raises(
        RegistrationError, match=r"storage_page_size \(100 tokens\).*host page size \(64 tokens\)"
    ):
        store.register_mem_pool_host(kv)
    del PoolName


def test_unsupported_pool_is_refused_at_registration(rig):
    store, _, _ = rig
    with pytest.raises(RegistrationError, match="auxiliary_swa"):
        store.register_mem_host_pool_v2(
            P.build_mla_host("page_first", layers=1, host_pages=2), "auxiliary_swa"
        )


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({"global_segment_size": "4xb"}, ConfigError, "global_segment_size"),
        ({"global_segment_size": -1}, ConfigError, "global_segment_size"),
        ({"protocol": "carrier-pigeon"}, ConfigError, "protocol 'carrier-pigeon'"),
        ({"metadata_server": "foo://x:1"}, ConfigError, "scheme 'foo' is not supported"),
        ({"master_server_address": "no-port"}, ConfigError, "host:port"),
        ({"span_colour": "blue"}, ConfigError, "span_colour"),
        ({"storage_page_size": -64}, ConfigError, "storage_page_size"),
        ({"span_group_ids": "perhaps"}, ConfigError, "span_group_ids"),
        ({"standalone_storage": True}, ConfigError, "standalone_storage"),
    ],
)
def test_bad_config_values_fail_construction(extra, error, match):
    from mooncake_span.sglang_backend import MooncakeSpanStore

    with pytest.raises(error, match=match):
        MooncakeSpanStore(make_storage_config({**FAKE_CLIENT, **extra}), {})


def test_unreachable_master_fails_fast():
    import socket
    import time

    from mooncake_span.sglang_backend import MooncakeSpanStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(SetupError, match=f"127.0.0.1:{port}"):
        MooncakeSpanStore(
            make_storage_config({**FAKE_CLIENT, "master_server_address": f"127.0.0.1:{port}"}), {}
        )
    assert time.monotonic() - started < 5


def test_dead_etcd_fails_fast_instead_of_blocking_minutes():
    import socket
    import time

    from mooncake_span.sglang_backend import MooncakeSpanStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(SetupError, match="cannot reach"):
        MooncakeSpanStore(
            make_storage_config(
                {
                    **FAKE_CLIENT,
                    "master_server_address": f"etcd://127.0.0.1:{port}",
                    "metadata_server": f"etcd://127.0.0.1:{port}",
                }
            ),
            {},
        )
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("config_field", "extra", "expected_k"),
    [
        (None, {"storage_page_size": 256}, 4),  # sglang 0.5.23: no field, extra-config applies
        (256, {}, 4),  # span-aware build: the field wins
        (0, {"storage_page_size": 256}, 1),  # field present and 0 = host page, authoritative
        (None, {}, 1),
    ],
)
def test_span_factor_source(make_backend, config_field, extra, expected_k):
    config = make_storage_config({**FAKE_CLIENT, **extra})
    if config_field is not None:
        config.storage_page_size = config_field
    store = make_backend(config)
    store.register_mem_pool_host(P.build_mla_host("page_first", layers=1, host_pages=4))
    assert store.geometry.pages_per_span == expected_k
    assert f"h64x{expected_k}" in store.key_schema.prefix
