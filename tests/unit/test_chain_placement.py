"""Prefix-chain placement: the pure rule (store/domains.py) and the backend's use of
sglang's ``extra_info.prefix_keys`` (sglang_backend/stored_pool.py), on the fake store."""

from __future__ import annotations

import hashlib
import logging
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_span.errors import InvalidRequestError
from mooncake_span.sglang_backend.stored_pool import chain_of
from mooncake_span.sglang_backend.writes import PASS_PREFIX_KEYS, PerKeyNotice
from mooncake_span.span.keys import KeySchema, RankTags
from mooncake_span.store.domains import ChainSpot, put_targets
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import FAKE_CLIENT, rank_segments, slots_of

SEGMENTS = tuple(f"10.0.0.{i}:1500{i}" for i in range(1, 7))
PAGE = 64


def _hex_chain(seed: int, length: int) -> list[str]:
    """Page keys shaped like sglang's: each a SHA-256 hex digest of the one before."""
    keys, last = [], f"seed-{seed}"
    for _ in range(length):
        last = hashlib.sha256(last.encode()).hexdigest()
        keys.append(last)
    return keys


def _homes(
    length: int, window_keys: int, segments: tuple[str, ...], cuts: list[int], copies: int = 1
) -> dict[int, list[str]]:
    """Chain position -> its copies' segments, the chain written in calls cut at ``cuts``."""
    spot_domain = "ms2_m_h64x1_pf_bf16_root"
    bounds = [0, *sorted({c for c in cuts if 0 < c < length}), length]
    out: dict[int, list[str]] = {}
    for start, stop in zip(bounds, bounds[1:], strict=False):
        spot = ChainSpot(spot_domain, start, window_keys)
        keys = [f"k{p}" for p in range(start, stop)]
        domains, steps = spot.objects(range(len(keys)), 1)
        targets = put_targets(keys, domains, segments, copies, frozenset(), steps)
        for segment, entries in targets.items():
            for i, obj in entries:
                out.setdefault(start + i, []).append((obj, segment))
    return {p: [s for _, s in sorted(v)] for p, v in out.items()}


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(1, 200),
    window_keys=st.integers(1, 64),
    nodes=st.integers(1, len(SEGMENTS)),
    cuts=st.lists(st.integers(0, 200), max_size=6),
)
def test_a_chain_sits_on_its_roots_segment_for_a_window_then_moves_to_the_next(
    length, window_keys, nodes, cuts
):
    segments = SEGMENTS[:nodes]
    order = rank_segments("ms2_m_h64x1_pf_bf16_root", segments)
    homes = _homes(length, window_keys, segments, cuts)
    assert sorted(homes) == list(range(length))
    for position, (segment,) in homes.items():
        assert segment == order[(position // window_keys) % nodes]
    # However the chain was cut into calls, its first window is on one node.
    assert {homes[p][0] for p in range(min(length, window_keys))} == {order[0]}


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 120), window_keys=st.integers(1, 40), copies=st.integers(1, 3))
def test_copy_r_of_a_chain_window_goes_to_the_r_th_segment_after_it(length, window_keys, copies):
    order = rank_segments("ms2_m_h64x1_pf_bf16_root", SEGMENTS)
    homes = _homes(length, window_keys, SEGMENTS, [], copies)
    for position, placed in homes.items():
        step = position // window_keys
        assert placed == [order[(step + r) % len(SEGMENTS)] for r in range(copies)]


@settings(max_examples=60, deadline=None)
@given(
    roots=st.lists(st.integers(0, 10**6), min_size=1, max_size=40, unique=True),
    gone=st.integers(0, len(SEGMENTS) - 1),
    window_keys=st.integers(1, 8),
    length=st.integers(1, 30),
)
def test_keys_move_when_the_live_set_changes_only_as_rendezvous_dictates(
    roots, gone, window_keys, length
):
    """A removed segment leaves every root's order otherwise as it was, and a new
    one only slots into it: chains inside one window move only if their node
    went away (or the new node wins their root); longer ones follow the new order."""
    before, after = SEGMENTS, tuple(s for i, s in enumerate(SEGMENTS) if i != gone)
    for root in roots:
        domain = f"ms2_m_h64x1_pf_bf16_{root:x}"
        old, new = rank_segments(domain, before), rank_segments(domain, after)
        assert new == [s for s in old if s != SEGMENTS[gone]]
        grown = rank_segments(domain, (*after, SEGMENTS[gone]))
        assert [s for s in grown if s != SEGMENTS[gone]] == new
        spot = ChainSpot(domain, 0, window_keys)
        keys = [f"{root}-{p}" for p in range(length)]
        domains, steps = spot.objects(range(length), 1)
        moved = put_targets(keys, domains, after, 1, frozenset(), steps)
        for segment, entries in moved.items():
            for i, _ in entries:
                assert segment == new[(i // window_keys) % len(after)]
                if i < window_keys and segment != old[0]:
                    assert old[0] == SEGMENTS[gone]


def test_a_bad_segment_moves_a_chain_window_to_the_next_live_one():
    order = rank_segments("root", SEGMENTS[:3])
    spot = ChainSpot("root", 0, 4)
    domains, steps = spot.objects(range(8), 1)
    keys = [f"k{i}" for i in range(8)]
    targets = put_targets(keys, domains, SEGMENTS[:3], 1, frozenset({order[0]}), steps)
    where = {i: seg for seg, entries in targets.items() for i, _ in entries}
    # Window 0 sat on order[0]: it goes to the first spare, the segment after its copies.
    assert {where[i] for i in range(4)} == {order[1]}
    assert {where[i] for i in range(4, 8)} == {order[1]}


def test_chain_spot_is_validated():
    with pytest.raises(ValueError):
        ChainSpot("d", -1, 4)
    with pytest.raises(ValueError):
        ChainSpot("d", 0, 0)
    assert ChainSpot("d", 5, 4).objects([0, 3, 4], 2) == (["d"] * 6, [1, 1, 2, 2, 2, 2])


# ---- the adapter: extra_info -> chain spot ------------------------------------------


def _schema() -> KeySchema:
    return KeySchema("m", 64, 1, "page_first", "bfloat16", RankTags.from_ranks(tp_rank=0))


def test_chain_of_follows_sglangs_prefix_keys():
    schema = _schema()
    a, b, c = _hex_chain(1, 3)
    assert chain_of(None, [a], schema, 8) is None
    assert chain_of(SimpleNamespace(prefix_keys=None), [a], schema, 8) is None
    (root,) = schema.domains([a], 1)
    assert chain_of(SimpleNamespace(prefix_keys=[]), [a, b], schema, 8) == ChainSpot(root, 0, 8)
    assert chain_of(SimpleNamespace(prefix_keys=[a, b]), [c], schema, 8) == ChainSpot(root, 2, 8)
    with pytest.raises(InvalidRequestError):
        chain_of(SimpleNamespace(prefix_keys="abc"), [a], schema, 8)
    with pytest.raises(InvalidRequestError):
        chain_of(SimpleNamespace(prefix_keys=[7]), [a], schema, 8)


def test_the_first_backup_without_prefix_keys_logs_one_line_naming_the_knob(caplog):
    notice = PerKeyNotice()
    with caplog.at_level(logging.INFO, logger="mooncake_span.sglang_backend.writes"):
        notice.backup(ChainSpot("d", 0, 1))
        notice.backup(None)
        notice.backup(None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and PASS_PREFIX_KEYS in lines[0] and "1/N" in lines[0]


# ---- the backend on the fake store, with a segment list ------------------------------


@pytest.fixture
def chain_rig(request):
    """The backend on 4 fake segments, a window of 4 keys and (unless the test
    passes ``stripe`` by indirect parametrization) a stripe of 4 keys too."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from mooncake_span.sglang_backend import MooncakeSpanStore
    from mooncake_span.store.client import NativeBinding
    from mooncake_span_tools.testing.fake_store import FakeReplicateConfig, FakeStore
    from tests.span_helpers import make_storage_config, register_pools, skip_probe

    cluster = FakeCluster(segments=SEGMENTS[:4])
    config = {
        **FAKE_CLIENT,
        "span_master_admin_url": "http://127.0.0.1:1",
        "span_chain_window_tokens": 4 * PAGE,
        "span_chain_stripe_tokens": getattr(request, "param", 4) * PAGE,
        "span_layout_guard": "off",
    }
    binding = NativeBinding(
        lambda: FakeStore(cluster),
        FakeReplicateConfig,
        lambda url: cluster.live_segments(),
        probe_endpoint=skip_probe,
    )
    store = MooncakeSpanStore(make_storage_config(config), {}, binding=binding)
    kv = P.build_mla_host("page_first", layers=1, host_pages=64)
    register_pools(store, {PoolName.KV: kv})
    yield store, cluster
    store.close()


def _info(prefix):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=prefix)


def test_a_conversation_written_over_several_calls_sits_on_its_roots_segments(chain_rig):
    store, cluster = chain_rig
    keys = _hex_chain(7, 10)
    for start, stop in ((0, 3), (3, 7), (7, 10)):
        part = keys[start:stop]
        ok = store.batch_set_v1(part, slots_of(list(range(start, stop)), PAGE), _info(keys[:start]))
        assert ok == [True] * len(part)
    schema = store.key_schema
    order = rank_segments(schema.domains([keys[0]], 1)[0], cluster.live_segments())
    placed = [
        cluster.placement[schema.object_keys([k], store.pools["kv"].components)[0]] for k in keys
    ]
    assert placed == [order[p // 4] for p in range(10)]
    # A hit query and a prefetch that name the chain read it back whole.
    assert store.batch_exists(keys, _info([])) == 10
    assert (
        store.batch_get_v1(keys[4:], slots_of(list(range(20, 26)), PAGE), _info(keys[:4]))
        == [True] * 6
    )


@pytest.mark.parametrize("chain_rig", [0], indirect=True)
def test_without_a_stripe_a_chain_moves_on_once_a_window(chain_rig):
    """The default (no stripe): past its first window a chain keeps one segment per
    window, so a backup call within a window is one native put."""
    store, cluster = chain_rig
    assert store.registration.chain_keys == (4, 0)
    keys = _hex_chain(12, 14)
    assert store.batch_set_v1(keys, slots_of(list(range(14)), PAGE), _info([])) == [True] * 14
    schema = store.key_schema
    order = rank_segments(schema.domains([keys[0]], 1)[0], cluster.live_segments())
    placed = [
        cluster.placement[schema.object_keys([k], store.pools["kv"].components)[0]] for k in keys
    ]
    assert placed == [order[(p // 4) % len(order)] for p in range(14)]


@pytest.mark.parametrize("chain_rig", [1, 2], indirect=True)
def test_past_its_first_window_a_chain_moves_on_every_stripe(chain_rig):
    """A long conversation's tail spreads over the root's ranking a stripe at a time,
    so one read of it reaches several segments; its first window stays on one."""
    store, cluster = chain_rig
    stripe = store.registration.chain_keys[1]
    keys = _hex_chain(11, 14)
    for start, stop in ((0, 5), (5, 14)):
        part = keys[start:stop]
        ok = store.batch_set_v1(part, slots_of(list(range(start, stop)), PAGE), _info(keys[:start]))
        assert ok == [True] * len(part)
    schema = store.key_schema
    order = rank_segments(schema.domains([keys[0]], 1)[0], cluster.live_segments())
    placed = [
        cluster.placement[schema.object_keys([k], store.pools["kv"].components)[0]] for k in keys
    ]
    steps = [0] * 4 + [1 + (p - 4) // stripe for p in range(4, 14)]
    assert placed == [order[step % len(order)] for step in steps]
    assert set(placed[4 : 4 + 4 * stripe]) == set(order)  # the tail reaches every segment
    assert store.batch_exists(keys, _info([])) == 14
    assert (
        store.batch_get_v1(keys[4:], slots_of(list(range(20, 30)), PAGE), _info(keys[:4]))
        == [True] * 10
    )


def test_reads_of_a_chain_skip_only_the_dead_window(chain_rig):
    store, cluster = chain_rig
    keys = _hex_chain(9, 8)
    assert store.batch_set_v1(keys, slots_of(list(range(8)), PAGE), _info([])) == [True] * 8
    schema = store.key_schema
    order = rank_segments(schema.domains([keys[0]], 1)[0], cluster.live_segments())
    cluster.kill_segment(order[1])  # the second window's node
    store.client.ledger.transfer_failed([order[1]], "get")
    assert store.batch_exists(keys, _info([])) == 4
    located: list[list[str]] = []
    native = store.client._native  # where DomainCalls asks the master
    locate = native.locate

    def counting(object_keys, sizes=None, **counted):
        located.append(list(object_keys))
        return locate(object_keys, sizes, **counted)

    native.locate = counting
    assert (
        store.batch_get_v1(keys[:4], slots_of(list(range(30, 34)), PAGE), _info([])) == [True] * 4
    )
    assert store.batch_exists(keys[:4], _info([])) == 4
    # The chain told the client where its keys are: no replica lookups were needed.
    assert located == []
    # A read that names no chain asks the master instead of guessing per key.
    assert store.batch_exists(keys[:4]) == 4
    assert [len(keys) for keys in located] == [1, 3]  # both probe rounds asked


def test_without_prefix_keys_placement_stays_per_key(chain_rig, caplog):
    store, cluster = chain_rig
    keys = _hex_chain(11, 12)
    with caplog.at_level(logging.INFO, logger="mooncake_span.sglang_backend.writes"):
        assert store.batch_set_v1(keys, slots_of(list(range(12)), PAGE)) == [True] * 12
        assert store.batch_set_v1(_hex_chain(12, 1), slots_of([20], PAGE), None) == [True]
    schema = store.key_schema
    segments = cluster.live_segments()
    for key in keys:
        (obj,) = schema.object_keys([key], store.pools["kv"].components)
        assert cluster.placement[obj] == rank_segments(schema.domain_of(obj), segments)[0]
    assert sum(PASS_PREFIX_KEYS in r.getMessage() for r in caplog.records) == 1


def test_the_knob_reaching_our_config_is_ignored_quietly(caplog):
    """sglang's controllers pop hicache_storage_pass_prefix_keys, but a config built
    by hand (or a harness handing the extra-config straight over) still carries it."""
    from mooncake_span.config import load_span_options

    with caplog.at_level(logging.WARNING, logger="mooncake_span.config"):
        options = load_span_options({PASS_PREFIX_KEYS: True, "span_chain_window_tokens": "4096"})
    assert options.chain_window_tokens == 4096
    assert caplog.records == []
    with pytest.raises(Exception, match="span_chain_window_tokens"):
        load_span_options({"span_chain_window_tokens": 0})
    assert load_span_options({"span_chain_stripe_tokens": "512"}).chain_stripe_tokens == 512
    assert load_span_options({}).chain_stripe_tokens == 0  # opt-in: one node per window
    with pytest.raises(Exception, match="span_chain_stripe_tokens must be in 0"):
        load_span_options({"span_chain_stripe_tokens": -1})


def test_the_window_model_of_the_bench_follows_the_rule():
    """Chains inside one window lose exactly 1/N on average over victims; a window of
    one key spreads each chain and loses more."""
    from mooncake_span_tools.bench.placement import conversations, window_model

    convs = conversations(3, 8)
    whole = window_model(convs, 4, 512)
    assert whole["mean_share"] == 0.75
    assert window_model(convs, 4, 1)["mean_share"] < whole["mean_share"]
