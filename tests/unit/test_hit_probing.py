"""Hit queries probe only what can be read (span.hit_rounds, sglang_backend.hit_query).

Mooncake 0.3.13 leases every existing object ``batch_is_exist`` finds, so the
bound that matters is which objects a query names. The backend runs on the
contract-checked fake store, wrapped to record the keys of every existence
call; the answers are compared with a reference that probes everything at once
and feeds ``compute_hits`` (the semantics tested in test_hits.py).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_span.span.geometry import PoolKind
from mooncake_span.span.hit_rounds import (
    KV_ROUNDS_ALONE,
    KV_ROUNDS_WITH_SIDECARS,
    ProbePolicy,
    ProbeTally,
    sidecar_pages,
)
from mooncake_span.span.hits import (
    ALL_PAGES,
    BLOCK_GROUPS,
    TRAILING_PAGES,
    PoolHitQuery,
    compute_hits,
    leading_run,
)
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster, FakeStore
from tests.span_helpers import FAKE_CLIENT, fake_backend, register_pools

PAGE = 64
SPAN = 4 * PAGE
KEYS = 24


# ---------------------------------------------------------------------------
# chunk policy (pure)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(1, 20), st.integers(0, 5), st.integers(1, 5))
def test_chunks_cover_the_query_in_order_within_the_round_cap(total, first, growth, rounds):
    chunks = ProbePolicy(first, growth).chunks(total, rounds)
    assert len(chunks) <= rounds
    assert [end for _, end in chunks][-1:] == ([total] if total else [])
    starts = [0, *[end for _, end in chunks[:-1]]][: len(chunks)]
    assert [start for start, _ in chunks] == starts
    assert all(end > start for start, end in chunks)
    if chunks:
        assert chunks[0][1] == min(total, first) or len(chunks) == rounds == 1
    # Every chunk but the last allowed one has its size: geometric, or the
    # rest of the query split evenly over the rounds left.
    for i, (start, end) in enumerate(chunks[: rounds - 1]):
        if i == 0:
            want = first
        elif growth:
            want = first * growth**i
        else:
            want = -(-(total - start) // (rounds - i))
        assert end - start == min(want, total - start)


def test_chunks_examples():
    policy = ProbePolicy()  # 1 key, then the rest in equal chunks
    assert policy.chunks(64, KV_ROUNDS_WITH_SIDECARS) == [(0, 1), (1, 33), (33, 64)]
    assert policy.chunks(24, KV_ROUNDS_WITH_SIDECARS) == [(0, 1), (1, 13), (13, 24)]
    assert ProbePolicy(4).chunks(24, 3) == [(0, 4), (4, 14), (14, 24)]
    assert ProbePolicy(4, 4).chunks(64, 3) == [(0, 4), (4, 20), (20, 64)]
    assert policy.chunks(128, KV_ROUNDS_ALONE) == [(0, 1), (1, 128)]
    assert policy.chunks(3, KV_ROUNDS_WITH_SIDECARS) == [(0, 1), (1, 2), (2, 3)]
    assert ProbePolicy(4).chunks(3, KV_ROUNDS_WITH_SIDECARS) == [(0, 3)]
    assert policy.chunks(0, 2) == []


@pytest.mark.parametrize(
    ("first", "growth", "rounds", "match"),
    [(0, 2, 1, "first_chunk_keys"), (1, -1, 1, "growth"), (1, 1, 0, "at least one probe round")],
)
def test_bad_policies_are_refused(first, growth, rounds, match):
    with pytest.raises(ValueError, match=match):
        ProbePolicy(first, growth).chunks(4, rounds)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 14),
    st.lists(
        st.tuples(
            st.sampled_from([ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS]),
            st.lists(st.booleans(), min_size=14, max_size=14),
            st.integers(1, 4),
            st.integers(0, 5),
            st.integers(0, 4),
        ),
        max_size=3,
    ),
)
def test_sidecar_pages_past_the_narrowing_never_change_the_answer(kv_pages, pools):
    """Flags cut to ``sidecar_pages`` give exactly the answer of the full flags."""
    full, cut = [], []
    for i, (policy, exists, window, block, group) in enumerate(pools):
        need = sidecar_pages(policy, kv_pages, block, group)
        assert need <= kv_pages
        for out, flags in ((full, exists), (cut, exists[:need])):
            out.append(PoolHitQuery(f"p{i}", policy, flags, window, block, group))
    a, b = compute_hits(kv_pages, full), compute_hits(kv_pages, cut)
    assert (a.kv_hit_pages, a.pool_hit_pages, a.restorable_prefix_pages) == (
        b.kv_hit_pages,
        b.pool_hit_pages,
        b.restorable_prefix_pages,
    )


def test_block_groups_skip_the_tail_group_cut_by_the_kv_prefix():
    assert sidecar_pages(BLOCK_GROUPS, 7, block_pages=0, group_pages=3) == 6
    assert sidecar_pages(BLOCK_GROUPS, 5, block_pages=4, group_pages=2) == 4
    assert sidecar_pages(ALL_PAGES, 7) == sidecar_pages(TRAILING_PAGES, 7) == 7


def test_tally_counts_only_rounds_that_name_objects():
    tally = ProbeTally()
    tally.add(3)
    tally.add(0)
    tally.add(5)
    assert (tally.rpcs, tally.objects) == (2, 8)


# ---------------------------------------------------------------------------
# the backend on the fake store


class RecordingStore(FakeStore):
    """The fake store, keeping the keys of every existence call."""

    def __init__(self, cluster: FakeCluster, asked: list[list[str]]) -> None:
        super().__init__(cluster)
        self._asked = asked

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._asked.append(list(keys))
        return super().batch_is_exist(keys)


@pytest.fixture(scope="module")
def rig():
    pool_set = P.build_compressed_hybrid_dsa("page_first", host_pages=8, mamba_slots=4)
    cluster, asked = FakeCluster(), []
    store = fake_backend(
        {**FAKE_CLIENT, "storage_page_size": SPAN},
        cluster=cluster,
        native=lambda c: RecordingStore(c, asked),
    )
    register_pools(store, pool_set.pools)
    yield store, cluster, asked
    store.close()


def _transfers(block_groups: tuple[int, int] | None = None):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    indexer = PoolTransfer(PoolName.INDEXER, keys=None, indices_from_pool=PoolName.KV)
    if block_groups is not None:
        indexer.hit_policy = PoolHitPolicy.BLOCK_GROUPS
        indexer.block_pages, indexer.group_pages = block_groups
    mamba = PoolTransfer(
        PoolName.MAMBA, keys=["placeholder"], hit_policy=PoolHitPolicy.TRAILING_PAGES
    )
    return [indexer, mamba]


def _objects(store, pool: str, keys: list[str]) -> list[str]:
    return store.pools[pool].object_keys(store.key_schema, keys)


def _stock(store, cluster, keys, kv, indexer, mamba) -> None:
    """Make exactly the objects the flags say exist (nothing else under these keys)."""
    for pool, flags in (("kv", kv), ("indexer", indexer), ("mamba", mamba)):
        for key, present in zip(keys, flags, strict=True):
            for obj in _objects(store, pool, [key]):
                if present:
                    cluster.objects[obj] = b"x"
                else:
                    cluster.objects.pop(obj, None)


def _reference(kv, indexer, mamba, block_groups):
    kv_pages = leading_run(kv)
    if block_groups is None:
        index_query = PoolHitQuery("indexer", ALL_PAGES, indexer[:kv_pages])
    else:
        block, group = block_groups
        index_query = PoolHitQuery("indexer", BLOCK_GROUPS, indexer[:kv_pages], 1, block, group)
    mamba_query = PoolHitQuery("mamba", TRAILING_PAGES, mamba[:kv_pages], window_pages=1)
    return compute_hits(kv_pages, [index_query, mamba_query])


def _query(store, asked, keys, transfers):
    asked.clear()
    store.get_stats()  # drain the counters
    result = store.batch_exists_v2(keys, transfers)
    flat = [k for call in asked for k in call]
    return result, flat, len(asked)


def _check_bounds(store, cluster, keys, flat, rpcs, kv_pages):
    """What the issue asks: KV objects of the hit prefix plus at most one chunk
    past the first miss, sidecars only inside the hit prefix, <= 2x upstream's RPCs."""
    kv_asked = [k for k in flat if k in set(_objects(store, "kv", keys))]
    chunks = store.prober.policy.chunks(len(keys), KV_ROUNDS_WITH_SIDECARS)
    miss_chunk = next(((s, e) for s, e in chunks if s <= kv_pages < e), None)
    kv_limit = len(keys) if miss_chunk is None else miss_chunk[1]
    assert set(kv_asked) <= set(_objects(store, "kv", keys[:kv_limit]))
    sidecars = set(flat) - set(kv_asked)
    allowed = set(_objects(store, "indexer", keys[:kv_pages]))
    allowed |= set(_objects(store, "mamba", keys[:kv_pages]))
    assert sidecars <= allowed
    upstream_rpcs = 1 + (1 if kv_pages else 0)
    assert rpcs <= 2 * upstream_rpcs
    leased = [k for k in flat if k in cluster.objects]
    assert len(flat) == len(set(flat))  # nothing is asked twice
    return leased


flag_lists = st.lists(st.booleans(), min_size=KEYS, max_size=KEYS)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.integers(0, KEYS),
    flag_lists,
    flag_lists,
    flag_lists,
    st.sampled_from([None, (0, 3), (8, 4)]),
)
def test_answers_match_the_probe_everything_reference_within_the_bounds(
    rig, kv_run, kv_tail, indexer, mamba, block_groups
):
    store, cluster, asked = rig
    keys = [f"q{i}" for i in range(KEYS)]
    kv = [True] * kv_run + [False] + kv_tail[kv_run + 1 :] if kv_run < KEYS else [True] * KEYS
    _stock(store, cluster, keys, kv, indexer, mamba)
    result, flat, rpcs = _query(store, asked, keys, _transfers(block_groups))
    want = _reference(kv, indexer, mamba, block_groups)
    assert result.kv_hit_pages == want.kv_hit_pages
    assert result.restorable_prefix_pages == want.restorable_prefix_pages
    assert {str(getattr(k, "value", k)): v for k, v in result.extra_pool_hit_pages.items()} == (
        want.pool_hit_pages
    )
    _check_bounds(store, cluster, keys, flat, rpcs, leading_run(kv))
    stats = store.get_stats()
    assert (stats.hit_queries, stats.hit_query_rpcs, stats.hit_query_probed_objects) == (
        1,
        rpcs,
        len(flat),
    )


@pytest.fixture
def stocked(rig):
    store, cluster, asked = rig
    keys = [f"s{i}" for i in range(KEYS)]
    _stock(store, cluster, keys, [True] * KEYS, [True] * KEYS, [True] * KEYS)
    return store, cluster, asked, keys


def test_first_key_miss_probes_only_the_first_chunk_of_kv(stocked):
    store, cluster, asked, keys = stocked
    query = ["absent", *keys[1:]]
    result, flat, rpcs = _query(store, asked, query, _transfers())
    assert result.kv_hit_pages == 0
    assert (rpcs, flat) == (1, _objects(store, "kv", query[:1]))
    assert not [k for k in flat if k in cluster.objects]  # nothing leased; upstream: 23


def test_middle_miss_probes_no_sidecar_past_the_miss(stocked):
    store, cluster, asked, keys = stocked
    query = [*keys[:10], "absent", *keys[11:]]
    result, flat, rpcs = _query(store, asked, query, _transfers())
    assert result.kv_hit_pages == 10
    # KV rounds [0,1) [1,13) stop at the miss; then one sidecar round.
    assert rpcs == 3
    want = _objects(store, "kv", query[:13])
    want += _objects(store, "indexer", query[:10]) + _objects(store, "mamba", query[:10])
    assert sorted(flat) == sorted(want)


def test_full_hit_probes_every_object_once_in_four_rounds(stocked):
    store, cluster, asked, keys = stocked
    result, flat, rpcs = _query(store, asked, keys, _transfers())
    assert result.kv_hit_pages == KEYS
    assert rpcs == 4  # 3 KV rounds + sidecars; upstream 2
    want = _objects(store, "kv", keys) + _objects(store, "indexer", keys)
    assert sorted(flat) == sorted(want + _objects(store, "mamba", keys))


def test_kv_only_query_takes_at_most_two_rounds(stocked):
    store, cluster, asked, keys = stocked
    asked.clear()
    assert store.batch_exists(keys) == KEYS
    assert [len(call) for call in asked] == [1, KEYS - 1]
    asked.clear()
    assert store.batch_exists(["absent", *keys[1:]]) == 0
    assert [len(call) for call in asked] == [1]


def test_unknown_policy_is_refused_before_anything_is_probed(stocked):
    store, cluster, asked, keys = stocked
    transfers = _transfers()
    transfers[0].hit_policy = "sometimes"
    result, flat, rpcs = _query(store, asked, keys, transfers)
    assert (result.kv_hit_pages, rpcs) == (0, 0)


def test_logical_anchor_lets_the_sidecars_decide_in_one_round(stocked):
    """DeepSeek-V4: the KV pool stores no bytes; every key asked is in the
    'KV-hit prefix', so all sidecars are probed, once."""
    from mooncake_span.sglang_backend.stored_pool import StoredPool

    store, cluster, asked, keys = stocked
    real_kv = store.pools["kv"]
    anchor = StoredPool("kv", None, PoolKind.KV_ANCHOR, PAGE, real_kv.components, None)
    cluster.objects.pop(_objects(store, "indexer", [keys[5]])[0])
    pairs = [(t, store.pools[str(t.name.value)]) for t in _transfers()]
    asked.clear()
    tally = ProbeTally()
    hit = store.prober.hits(store.key_schema, anchor, keys, pairs, tally)
    assert (hit.kv_hit_pages, hit.pool_hit_pages["indexer"]) == (5, 5)
    assert (tally.rpcs, len(asked)) == (1, 1)
    assert sorted(asked[0]) == sorted(
        _objects(store, "indexer", keys) + _objects(store, "mamba", keys)
    )


def test_prometheus_counts_queries_rpcs_and_probed_objects(stocked):
    prom = pytest.importorskip("prometheus_client")
    from mooncake_span import metrics as M
    from mooncake_span.sglang_backend.recording import CallObserver

    store, cluster, asked, keys = stocked
    registry = prom.CollectorRegistry()
    recorder = store.recorder
    observer, recorder.observer = (
        recorder.observer,
        CallObserver(store.client, M.SpanMetrics(registry)),
    )
    try:
        asked.clear()
        store.batch_exists_v2([*keys[:10], "absent"], _transfers())
        store.batch_exists(["absent"])
    finally:
        recorder.observer = observer

    def value(name):
        return registry.get_sample_value(name, {}) or 0.0

    assert value("mooncake_span_hit_queries_total") == 2
    # 11 keys: KV rounds [0,1) [1,6) [6,11), the sidecars, then the lone miss.
    assert value("mooncake_span_hit_query_rpcs_total") == len(asked) == 5
    assert value("mooncake_span_hit_query_probed_objects_total") == sum(map(len, asked))
