"""Object seals (``span_object_checksums``, store/seal.py) on the contract-checked fake.

The fake keeps each object's bytes as Mooncake would (what the multi-buffer
put gathered, in order) and refuses any buffer outside registered memory, so
the trailers' arena is checked for registration too. A real cluster, an SSD
tier and restarts: tests/integration/test_ssd_integrity.py.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mooncake_span.config import load_span_options
from mooncake_span.errors import ErrorCode
from mooncake_span.span.plan import ObjectPlan
from mooncake_span.store import seal
from mooncake_span.store.arena import StagingArena
from mooncake_span.store.layout_guard import (
    GeometryRecord,
    check_layout_guard,
    create_text,
    read_text,
)
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import fake_client, listening_port

PAGE_BYTES = 512
PAGES_PER_KEY = 4


def test_the_option_is_decided_at_connect_by_default_and_parsed_strictly():
    # None: the client seals where the cluster has an SSD tier (store/ssd_marker.py).
    assert load_span_options({}, {}).object_checksums is None
    assert load_span_options({"span_object_checksums": "true"}, {}).object_checksums is True
    env = {"MOONCAKE_SPAN_OBJECT_CHECKSUMS": "1"}
    assert load_span_options({}, env).object_checksums is True
    with pytest.raises(ValueError, match="span_object_checksums"):
        load_span_options({"span_object_checksums": "maybe"}, {})


def test_a_trailer_binds_the_bytes_to_their_key():
    payload = bytes(range(256)) * 8
    stored = payload + seal.trailer_bytes("a", payload)
    assert len(stored) == len(payload) + seal.TRAILER_BYTES
    assert seal.check_stored("a", stored) is True
    assert seal.check_stored("b", stored) is False  # another key's object
    flipped = bytearray(stored)
    flipped[100] ^= 0x01
    assert seal.check_stored("a", bytes(flipped)) is False
    assert seal.check_stored("a", payload) is None  # no trailer: nothing to check


@pytest.fixture
def sealed():
    cluster = FakeCluster()
    with listening_port() as master:
        client = fake_client(master, cluster, placement=False, object_checksums=True)
        yield client, cluster
        client.close()


def _pages(client, count: int, seed: int = 5) -> np.ndarray:
    pages = np.random.default_rng(seed).integers(0, 256, count * PAGE_BYTES, dtype=np.uint8)
    client.register_buffer(pages.ctypes.data, pages.nbytes)
    return pages


def _span_plans(pages: np.ndarray, keys: int, order: list[int] | None = None) -> list[ObjectPlan]:
    """One object per key of K pages, each page its own buffer (``order``: which host
    page holds each key page, so a span's pages need not be adjacent)."""
    order = order or list(range(keys * PAGES_PER_KEY))
    base = pages.ctypes.data
    return [
        ObjectPlan(
            [base + order[k * PAGES_PER_KEY + j] * PAGE_BYTES for j in range(PAGES_PER_KEY)],
            [PAGE_BYTES] * PAGES_PER_KEY,
        )
        for k in range(keys)
    ]


def test_span_and_single_page_objects_round_trip_with_a_trailer_stored(sealed):
    client, cluster = sealed
    source = _pages(client, 8)
    assert client.put(["s0", "s1"], _span_plans(source, 2)) == [True, True]
    single = [ObjectPlan([source.ctypes.data + i * PAGE_BYTES], [PAGE_BYTES]) for i in range(2)]
    assert client.put(["p0", "p1"], single) == [True, True]
    span_bytes = PAGES_PER_KEY * PAGE_BYTES
    assert len(cluster.objects["s0"]) == span_bytes + seal.TRAILER_BYTES
    assert seal.check_stored("s1", cluster.objects["s1"]) is True
    assert seal.check_stored("p0", cluster.objects["p0"]) is True
    target = _pages(client, 8, seed=9)
    # Read into scattered pages: the check follows the object's order, not the memory's.
    order = [7, 2, 5, 0, 1, 6, 3, 4]
    assert client.get(["s0", "s1"], _span_plans(target, 2, order)) == [True, True]
    for k in range(8):
        got = target[order[k] * PAGE_BYTES : (order[k] + 1) * PAGE_BYTES]
        assert got.tobytes() == source[k * PAGE_BYTES : (k + 1) * PAGE_BYTES].tobytes()
    plans = [ObjectPlan([target.ctypes.data + i * PAGE_BYTES], [PAGE_BYTES]) for i in range(2)]
    assert client.get(["p0", "p1"], plans) == [True, True]
    assert target[: 2 * PAGE_BYTES].tobytes() == source[: 2 * PAGE_BYTES].tobytes()


@pytest.mark.parametrize("where", ["payload", "trailer", "magic"])
def test_a_changed_byte_is_a_miss_for_that_key_only_and_is_removed(sealed, where):
    client, cluster = sealed
    source = _pages(client, 12)
    keys = ["k0", "k1", "k2"]
    assert client.put(keys, _span_plans(source, 3)) == [True] * 3
    stored = bytearray(cluster.objects["k1"])
    at = {"payload": 700, "trailer": len(stored) - 1, "magic": len(stored) - 16}[where]
    stored[at] ^= 0x40
    cluster.objects["k1"] = bytes(stored)
    target = _pages(client, 12, seed=11)
    assert client.get(keys, _span_plans(target, 3)) == [True, False, True]
    span = PAGES_PER_KEY * PAGE_BYTES
    assert target[:span].tobytes() == source[:span].tobytes()
    assert target[2 * span :].tobytes() == source[2 * span :].tobytes()
    assert "k1" not in cluster.objects  # removed: no hit query offers it again
    assert client.exists(keys) == [True, False, True]
    stats = client.stats()
    assert stats["integrity_failures"] == {"SEAL_MISMATCH": 1}
    assert stats["integrity_removed"] == 1
    assert stats["breaker_consecutive_failures"] == 0


def test_without_the_option_the_same_flip_is_returned_as_a_hit():
    """Negative control: the check above is what catches the flip."""
    cluster = FakeCluster()
    with listening_port() as master:
        client = fake_client(master, cluster, placement=False)
        try:
            source = _pages(client, 4)
            assert client.put(["k"], _span_plans(source, 1)) == [True]
            stored = bytearray(cluster.objects["k"])
            stored[700] ^= 0x40
            cluster.objects["k"] = bytes(stored)
            target = _pages(client, 4, seed=11)
            assert client.get(["k"], _span_plans(target, 1)) == [True]
            assert target.tobytes() != source.tobytes()
        finally:
            client.close()


def test_unsealed_objects_never_read_as_sealed_ones(sealed):
    client, cluster = sealed
    source = _pages(client, 4)
    assert client.put(["old"], _span_plans(source, 1), sealed=False) == [True]
    target = _pages(client, 4, seed=2)
    # An object of the old format is shorter than a sealed read plans: a miss, not bytes.
    assert client.get(["old"], _span_plans(target, 1)) == [False]
    assert client.get(["old"], _span_plans(target, 1), sealed=False) == [True]


def test_a_corrupt_copy_falls_back_to_the_good_one():
    cluster = FakeCluster(segments=("127.0.0.1:12001", "127.0.0.1:12002"))
    with listening_port() as master:
        client = fake_client(master, cluster, replica_num=2, object_checksums=True)
        try:
            source = _pages(client, 4)
            assert client.put(["k"], _span_plans(source, 1)) == [True]
            copies = sorted(k for k in cluster.objects if k.startswith("k"))
            assert len(copies) == 2
            stored = bytearray(cluster.objects[copies[0]])
            stored[5] ^= 0x01
            cluster.objects[copies[0]] = bytes(stored)
            target = _pages(client, 4, seed=3)
            assert client.get(["k"], _span_plans(target, 1)) == [True]
            assert target.tobytes() == source.tobytes()
            assert client.stats()["integrity_failures"] == {"SEAL_MISMATCH": 1}
        finally:
            client.close()


def test_guard_records_stay_unsealed_so_any_node_reads_them(sealed):
    client, cluster = sealed
    arena = StagingArena(1 << 16, client.register_buffer, 1.0)
    assert create_text(client, arena, "blob", "hello")
    assert cluster.objects["blob"] == b"hello"
    assert read_text(client, arena, "blob") == "hello"


def test_the_layout_guard_refuses_a_node_of_the_other_format(sealed):
    client, _ = sealed
    arena = StagingArena(1 << 16, client.register_buffer, 1.0)
    schema = _schema()
    record = GeometryRecord(64, 256, "page_first", "bf16")
    plain = load_span_options({"span_layout_guard": "store"}, {})
    on = load_span_options({"span_layout_guard": "store", "span_object_checksums": True}, {})
    assert check_layout_guard(plain, schema, record, client, arena) == "published"
    from mooncake_span.errors import LayoutConflictError

    with pytest.raises(LayoutConflictError, match="object_format.*xxh3-64-trailer-v1.*plain"):
        check_layout_guard(on, schema, record, client, arena)
    assert check_layout_guard(plain, schema, record, client, arena) == "matched"


def test_a_record_published_before_the_field_reads_as_plain():
    legacy = '{"host_page_tokens":64,"kv_dtype":"bf16","layout":"page_first","pools":{},'
    legacy += '"storage_page_tokens":256,"version":1}'
    assert GeometryRecord.from_json(legacy).object_format == seal.PLAIN_FORMAT


def test_a_get_bigger_than_the_trailer_arena_is_refused_not_sent_unregistered(sealed):
    client, _ = sealed
    arena_objects = seal.DEFAULT_ARENA_BYTES // 32
    source = _pages(client, 1)
    plans = [ObjectPlan([source.ctypes.data], [16])] * (arena_objects + 1)
    with pytest.raises(ValueError, match="staging arena"):
        client.get([f"k{i}" for i in range(arena_objects + 1)], plans)
    assert int(ErrorCode.SEAL_MISMATCH) == seal.MISMATCH


def _schema():
    from mooncake_span.span.keys import KeySchema, RankTags

    return KeySchema("m", 64, 4, "page_first", "bf16", RankTags.from_ranks(tp_rank=0))


def test_the_digest_reads_buffers_in_place():
    data = (ctypes.c_char * 64).from_buffer_copy(bytes(range(64)))
    base = ctypes.addressof(data)
    whole = seal.payload_digest(7, [base], [64])
    assert seal.payload_digest(7, [base, base + 10], [10, 54]) == whole
    assert seal.payload_digest(8, [base], [64]) != whole
