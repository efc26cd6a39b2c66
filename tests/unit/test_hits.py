"""Hit-prefix math for batch_exists_v2 (mooncake_span.span.hits).

The worked examples are sglang 0.5.23's semantics written out as tables; the
property tests compare against brute-force references that check every stop
point (and every group) separately, with no prefix sums or early exits.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_span.errors import InvalidRequestError
from mooncake_span.span.hits import (
    ALL_PAGES,
    BLOCK_GROUPS,
    TRAILING_PAGES,
    PoolHitQuery,
    block_group_pages,
    compute_hits,
    leading_run,
    trailing_restorable,
)


def flags(text: str) -> list[bool]:
    """'TTF T' -> [True, True, False, True] (spaces are for readability)."""
    return [c == "T" for c in text if c != " "]


def at(positions: set[int], n: int) -> list[bool]:
    """Existence flags with True only at the given 1-based pages (checkpoints)."""
    return [page in positions for page in range(1, n + 1)]


# ---------------------------------------------------------------------------
# Worked examples


@pytest.mark.parametrize(
    ("kv", "pools", "kv_hit", "hits", "restorable"),
    [
        pytest.param(
            "TTTTTT",
            [PoolHitQuery("indexer", ALL_PAGES, flags("TTT F TT"))],
            3,
            {"kv": 6, "indexer": 3},
            [1, 2, 3],
            id="A-indexer-all-pages",
        ),
        pytest.param(
            "TTTTTT",
            [PoolHitQuery("mamba", TRAILING_PAGES, at({2, 4}, 6), window_pages=1)],
            4,
            {"kv": 6, "mamba": 4},
            [2, 4],
            id="B-mamba-checkpoints",
        ),
        pytest.param(
            "TTTTTT",
            [PoolHitQuery("swa", TRAILING_PAGES, flags("F T T F T T"), window_pages=2)],
            6,
            {"kv": 6, "swa": 6},
            [3, 6],
            id="C-swa-window-2",
        ),
        pytest.param(
            "TTTTT F",
            [
                PoolHitQuery("indexer", ALL_PAGES, flags("TTT F TT")),
                PoolHitQuery("mamba", TRAILING_PAGES, at({2, 4}, 6), window_pages=1),
            ],
            2,
            {"kv": 5, "indexer": 3, "mamba": 4},
            [2],
            id="D-kv-indexer-mamba",
        ),
        pytest.param(
            # S = 256 tokens (K = 4): "h0" holds KV and Mamba, "missing" nothing.
            "T F",
            [PoolHitQuery("mamba", TRAILING_PAGES, flags("T F"), window_pages=1)],
            1,
            {"kv": 1, "mamba": 1},
            [1],
            id="span-h0-missing",
        ),
    ],
)
def test_worked_examples(kv, pools, kv_hit, hits, restorable):
    kv_pages = leading_run(flags(kv))
    result = compute_hits(kv_pages, pools)
    assert (result.kv_hit_pages, result.pool_hit_pages, result.restorable_prefix_pages) == (
        kv_hit,
        hits,
        restorable,
    )


def test_example_b_stopping_at_3_is_illegal():
    result = compute_hits(6, [PoolHitQuery("mamba", TRAILING_PAGES, at({2, 4}, 6))])
    assert 3 not in result.restorable_prefix_pages


def test_example_e_ranks_agree_on_the_intersection_not_the_minimum():
    # Two ranks' restorable sets; the agreed length is the largest common one.
    rank0 = compute_hits(6, [PoolHitQuery("mamba", TRAILING_PAGES, at({2, 4, 6}, 6))])
    rank1 = compute_hits(6, [PoolHitQuery("mamba", TRAILING_PAGES, at({2, 5}, 6))])
    assert rank0.restorable_prefix_pages == [2, 4, 6]
    assert rank1.restorable_prefix_pages == [2, 5]
    common = set(rank0.restorable_prefix_pages) & set(rank1.restorable_prefix_pages)
    assert max(common) == 2
    assert min(rank0.kv_hit_pages, rank1.kv_hit_pages) == 5  # the wrong answer


def test_no_kv_hit_reports_nothing():
    result = compute_hits(0, [PoolHitQuery("indexer", ALL_PAGES, flags("TTT"))])
    assert (result.kv_hit_pages, result.pool_hit_pages, result.restorable_prefix_pages) == (
        0,
        {},
        [],
    )


def test_kv_only_hits_everything():
    result = compute_hits(4, [])
    assert (result.kv_hit_pages, result.pool_hit_pages, result.restorable_prefix_pages) == (
        4,
        {"kv": 4},
        [1, 2, 3, 4],
    )


def test_pool_flags_past_kv_pages_are_ignored_and_short_lists_count_as_missing():
    # The indexer exists beyond the KV prefix; that must not lift its verdict.
    long = compute_hits(3, [PoolHitQuery("indexer", ALL_PAGES, flags("TTTTTT"))])
    assert long.pool_hit_pages == {"kv": 3, "indexer": 3}
    # Fewer flags than KV pages: the absent ones are misses.
    short = compute_hits(4, [PoolHitQuery("indexer", ALL_PAGES, flags("TT"))])
    assert (short.kv_hit_pages, short.pool_hit_pages) == (2, {"kv": 4, "indexer": 2})


def test_pools_after_an_empty_restorable_set_get_no_verdict():
    # sglang stops at the first pool that leaves nothing restorable.
    result = compute_hits(
        3,
        [
            PoolHitQuery("indexer", ALL_PAGES, flags("FTT")),
            PoolHitQuery("mamba", TRAILING_PAGES, flags("TTT")),
        ],
    )
    assert (result.kv_hit_pages, result.pool_hit_pages, result.restorable_prefix_pages) == (
        0,
        {"kv": 3},
        [],
    )


def test_unknown_policy_is_rejected_with_the_pool_name():
    with pytest.raises(InvalidRequestError, match="'mamba'.*'sometimes'"):
        PoolHitQuery("mamba", "sometimes", [True])


# ---------------------------------------------------------------------------
# trailing_restorable


def naive_trailing(page_exists: list[bool], window: int) -> list[int]:
    """Stop L is legal when each of the (up to) ``window`` pages before L exists."""
    n = max(1, window)
    out = []
    for stop in range(1, len(page_exists) + 1):
        ok = True
        for page in range(stop - n, stop):
            if page >= 0 and not page_exists[page]:
                ok = False
        if ok:
            out.append(stop)
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), max_size=24), st.integers(-2, 10))
def test_trailing_restorable_matches_naive(page_exists, window):
    assert trailing_restorable(page_exists, window) == naive_trailing(page_exists, window)


@pytest.mark.parametrize(
    ("text", "window", "expected"),
    [
        ("", 1, []),
        ("FFF", 1, []),
        ("TTT", 1, [1, 2, 3]),
        ("FTFT", 1, [2, 4]),
        ("FTTFTT", 2, [3, 6]),
        # Shorter than the window: the whole prefix must exist.
        ("TTF", 4, [1, 2]),
        ("FTTTT", 3, [4, 5]),
        # Window <= 0 is treated as 1.
        ("FT", 0, [2]),
    ],
)
def test_trailing_restorable_examples(text, window, expected):
    assert trailing_restorable(flags(text), window) == expected


# ---------------------------------------------------------------------------
# compute_hits against a brute-force reference


def naive_compute(kv_pages: int, pools: list[tuple[str, str, list[bool], int, int, int]]):
    """Per stop point, ask every gating pool whether it can serve that prefix."""
    hits = {"kv": kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for name, policy, exists_all, window, block, group in pools:
        if not restorable:
            break
        exists = [i < len(exists_all) and exists_all[i] for i in range(kv_pages)]
        if policy == ALL_PAGES:
            legal = [s for s in range(1, kv_pages + 1) if all(exists[:s])]
        elif policy == TRAILING_PAGES:
            legal = naive_trailing(exists, window)
        else:
            boundary = naive_block_groups(exists, block, group)
            if boundary:
                hits[name] = boundary
            continue  # never gates KV
        if legal:
            hits[name] = max(legal)
        restorable = [s for s in restorable if s in legal]
    return (restorable[-1] if restorable else 0), hits, restorable


pool_queries = st.tuples(
    st.sampled_from(["a", "b", "c", "d"]),
    st.sampled_from([ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS]),
    st.lists(st.booleans(), max_size=14),
    st.integers(1, 4),
    st.integers(0, 5),
    st.integers(0, 4),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.booleans(), max_size=12),
    st.lists(pool_queries, max_size=4, unique_by=lambda q: q[0]),
)
def test_compute_hits_matches_naive(kv_flags, queries):
    kv_pages = leading_run(kv_flags)
    pools = [
        PoolHitQuery(name, policy, exists, window_pages=w, block_pages=b, group_pages=g)
        for name, policy, exists, w, b, g in queries
    ]
    result = compute_hits(kv_pages, pools)
    expected = naive_compute(kv_pages, queries)
    assert (result.kv_hit_pages, result.pool_hit_pages, result.restorable_prefix_pages) == expected
    # Structural guarantees sglang relies on.
    assert result.restorable_prefix_pages == sorted(set(result.restorable_prefix_pages))
    assert all(1 <= s <= kv_pages for s in result.restorable_prefix_pages)
    assert result.kv_hit_pages <= kv_pages
    assert all(v > 0 for v in result.pool_hit_pages.values())


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 10),
    st.lists(st.booleans(), max_size=10),
    st.lists(st.booleans(), max_size=10),
    st.integers(0, 4),
    st.integers(0, 4),
)
def test_block_groups_never_gates_kv(kv_pages, mamba, blocks, block_pages, group_pages):
    gating = [PoolHitQuery("mamba", TRAILING_PAGES, mamba)]
    block_pool = PoolHitQuery(
        "c4", BLOCK_GROUPS, blocks, block_pages=block_pages, group_pages=group_pages
    )
    with_block = compute_hits(kv_pages, [block_pool, *gating])
    without = compute_hits(kv_pages, gating)
    assert with_block.kv_hit_pages == without.kv_hit_pages
    assert with_block.restorable_prefix_pages == without.restorable_prefix_pages


def test_block_groups_missing_everything_still_leaves_kv_hit():
    result = compute_hits(4, [PoolHitQuery("c4", BLOCK_GROUPS, flags("FFFF"), group_pages=2)])
    assert (result.kv_hit_pages, result.pool_hit_pages, result.restorable_prefix_pages) == (
        4,
        {"kv": 4},
        [1, 2, 3, 4],
    )


# ---------------------------------------------------------------------------
# block_group_pages


def naive_block_groups(page_exists: list[bool], block_pages: int, group_pages: int) -> int:
    """Label every page with (block, group-in-block); walk the groups in order.

    A group's nominal extent is ``group`` pages, shortened only by its block's
    end; it is whole when that whole extent lies inside the query.
    """
    total = len(page_exists)
    group = max(1, group_pages)
    block = block_pages if block_pages > 0 else total + group  # 0: no block boundaries
    labels = [(p // block, (p % block) // group) for p in range(total)]
    covered = 0
    seen = []
    for label in labels:
        if label not in seen:
            seen.append(label)
    for blk, grp in seen:
        first = blk * block + grp * group
        nominal_end = min(first + group, (blk + 1) * block)
        members = [p for p in range(total) if labels[p] == (blk, grp)]
        if nominal_end > total:
            break
        if not all(page_exists[p] for p in members):
            break
        covered = nominal_end
    return covered


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=20), st.integers(0, 7), st.integers(0, 5))
def test_block_group_pages_matches_naive(page_exists, block_pages, group_pages):
    assert block_group_pages(page_exists, block_pages, group_pages) == naive_block_groups(
        page_exists, block_pages, group_pages
    )


@pytest.mark.parametrize(
    ("text", "block", "group", "expected"),
    [
        ("", 0, 2, 0),
        ("TTTT", 0, 2, 4),
        ("TTTF", 0, 2, 2),
        ("TFTT", 0, 2, 0),
        # group_pages 0/1: every page is its own group -> the leading run.
        ("TTFT", 0, 0, 2),
        ("TTFT", 0, 1, 2),
        # Blocks of 3 with groups of 2: groups [0,2) [2,3) [3,5) [5,6).
        ("TTTTTT", 3, 2, 6),
        ("TTT F TT", 3, 2, 3),
        # The group [3,5) would end past the query (4 pages): not whole.
        ("TTTT", 3, 2, 3),
        # A block that is cut short by the end of the query.
        ("TTTTT", 4, 2, 4),
        # block_pages 0: no block boundaries; a short tail group is cut by the
        # end of the query, so it is not whole.
        ("TTTTTT", 0, 3, 6),
        ("TTTTT F", 0, 3, 3),
        ("TTT", 0, 2, 2),
    ],
)
def test_block_group_pages_examples(text, block, group, expected):
    assert block_group_pages(flags(text), block, group) == expected


def test_block_groups_verdict_is_reported_under_the_pool_name():
    result = compute_hits(
        6, [PoolHitQuery("c4", BLOCK_GROUPS, flags("TTTT F T"), block_pages=0, group_pages=2)]
    )
    assert result.pool_hit_pages == {"kv": 6, "c4": 4}


# ---------------------------------------------------------------------------
# leading_run


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), max_size=30))
def test_leading_run_matches_naive(values):
    count = 0
    while count < len(values) and values[count]:
        count += 1
    assert leading_run(values) == count


@pytest.mark.parametrize(
    ("text", "expected"), [("", 0), ("F", 0), ("T", 1), ("TTF T", 2), ("TTTT", 4), ("FTTT", 0)]
)
def test_leading_run_examples(text, expected):
    assert leading_run(flags(text)) == expected
