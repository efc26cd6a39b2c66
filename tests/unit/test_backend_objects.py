"""A call's flat object list over its batches: sliced per batch, folded per key,
and a subset selected to move, its results put back in their slots (stored_pool.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_span.sglang_backend.stored_pool import (
    PoolBatch,
    StagedPool,
    StoredPool,
    Transfer,
    clamp_after_first_failure,
    move_selected,
    object_keys,
    per_batch,
    per_key_results,
    split,
)
from mooncake_span.span.geometry import PoolKind
from mooncake_span.span.keys import ComponentSpec, RankScope
from mooncake_span.span.plan import PageLayout

LAYOUT = PageLayout(
    base_ptrs=(0, 4096),
    page_stride_bytes=(64, 64),
    slot_bytes=(64, 64),
    components=((0,), (1,)),
    num_pages=8,
)
TWO = (ComponentSpec("a", RankScope.SHARDED), ComponentSpec("b", RankScope.SHARDED))


def _batch(name: str, keys: list[str], *, staged: bool = False, logical: bool = False):
    pool_class = StagedPool if staged else StoredPool
    layout = None if logical else LAYOUT
    pool = pool_class(name, None, PoolKind.STATE, 64, TWO, layout)
    batch = PoolBatch(pool, keys, np.zeros((len(keys), 1), dtype=np.int64))
    if not logical:
        batch.object_keys = [f"{name}/{k}/{c.name}" for k in keys for c in TWO]
    return batch


def test_split_and_per_batch_cut_consecutive_parts():
    assert split(list("abcdef"), [2, 0, 3, 1]) == [["a", "b"], [], ["c", "d", "e"], ["f"]]
    first, second = _batch("x", ["k0"]), _batch("y", ["k1", "k2"])
    assert per_batch(list(range(6)), [first, second]) == [[0, 1], [2, 3, 4, 5]]
    assert object_keys([first, second]) == [*first.object_keys, *second.object_keys]


def test_per_key_results_fold_components_and_clamp_after_the_first_missing_key():
    first = _batch("x", ["k0", "k1"])
    logical = _batch("l", ["k0"], logical=True)
    second = _batch("y", ["k0", "k1", "k2"])
    flags = [True, True, True, False] + [True, True, False, True, True, True]
    assert per_key_results([first, logical, second], flags) == [
        [True, False],
        [True],  # a logical anchor stores nothing: every key answers True
        [True, False, False],  # no True after a False
    ]


@pytest.mark.parametrize("staged_second", [False, True])
def test_move_selected_moves_only_the_named_objects_and_keeps_the_rest(staged_second):
    first = _batch("x", ["k0", "k1"])
    second = _batch("y", ["k0"], staged=staged_second)
    third = _batch("z", ["k0"])
    todos = [Transfer([1, 3], None, None), Transfer(None, None, None), Transfer([], None, None)]
    calls = []

    def staged(batch, todo):
        calls.append(("staged", batch.pool.name))
        return [False] * len(todo.object_indices or batch.object_keys)

    def direct(keys, direct_todos):
        calls.append(("direct", tuple(keys)))
        return [False] * len(keys)

    done = [True] * 8
    out = move_selected([first, second, third], todos, done, staged, direct)
    # Objects 1 and 3 of the first batch and both of the second moved (and failed here);
    # every object not moved keeps its flag.
    assert out == [True, False, True, False, False, False, True, True]
    moved_direct = [first.object_keys[1], first.object_keys[3]]
    if staged_second:
        assert calls == [("staged", "y"), ("direct", tuple(moved_direct))]
    else:
        assert calls == [("direct", (*moved_direct, *second.object_keys))]


# A pool's per-key results as a prefix (``clamp_after_first_failure``).


def flags(text: str) -> list[bool]:
    return [c == "T" for c in text]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), max_size=30))
def test_clamp_after_first_failure(values):
    clamped = clamp_after_first_failure(values)
    assert len(clamped) == len(values)
    assert all(type(v) is bool for v in clamped)
    # Never True after a False.
    for i, value in enumerate(clamped):
        if not value:
            assert not any(clamped[i:])
            break
    # Only ever removes successes, and keeps every success before the first failure.
    assert all(values[i] or not clamped[i] for i in range(len(values)))
    first_false = values.index(False) if False in values else len(values)
    assert clamped == [True] * first_false + [False] * (len(values) - first_false)


def test_clamp_examples():
    assert clamp_after_first_failure(flags("TTFTT")) == flags("TTFFF")
    assert clamp_after_first_failure([]) == []
    # Truthy non-bools (native 1/0 codes) come back as real bools.
    assert clamp_after_first_failure([1, 1, 0, 1]) == [True, True, False, False]
