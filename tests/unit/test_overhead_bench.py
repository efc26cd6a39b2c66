"""The overhead bench's do-nothing store and one measured cell.

``bench --overhead`` subtracts the CPU time spent inside ``NullStore`` from the
adapters' time, so the null store has to answer like a store that kept the
objects (or the contenders' results would not be checked) and has to count
its own time.
"""

from __future__ import annotations

import pytest

from mooncake_span.errors import ErrorCode
from mooncake_span_tools.bench import overhead as O


def test_null_store_answers_like_a_store_that_kept_the_objects():
    store = O.NullStore()
    assert store.batch_is_exist(["a", "b"]) == [0, 0]
    assert store.batch_put_from_multi_buffers(["a"], [[1, 2]], [[10, 20]], None) == [0]
    assert store.batch_is_exist(["a", "b"]) == [1, 0]
    assert store.batch_get_into_multi_buffers(["a", "b"], [[1, 2], [3]], [[10, 20], [5]]) == [
        30,
        int(ErrorCode.OBJECT_NOT_FOUND),
    ]
    assert store.batch_get_into(["a"], [7], [99]) == [99]
    assert store.remove_all(True) == 1
    assert store.batch_is_exist(["a"]) == [0]


def test_null_store_counts_its_own_cpu_time():
    store = O.NullStore()
    keys = [f"k{i}" for i in range(20000)]
    before = store.inside_s
    store.batch_put_from_multi_buffers(keys, [[0]] * len(keys), [[1]] * len(keys), None)
    store.batch_is_exist(keys)
    assert store.inside_s > before


def test_one_null_cell_measures_adapter_time_net_of_the_store():
    contenders = ("span-K4", "upstream")
    with O._listening_port() as port:
        native = O.NullStore()
        config = {"master_server_address": port, "metadata_server": "P2PHANDSHAKE"}
        cell = O.Cell("null", "mla", O.SMALL, 64, contenders)
        rig = O._Rig(cell, native, O._CpuClock(native), config)
        try:
            samples = O._measure(rig, contenders, reps=1, calls_per_rep=1)
        finally:
            rig.close()
    assert {(s.contender, s.op) for s in samples} == {
        (c, op) for c in contenders for op in ("put", "get", "exists")
    }
    for sample in samples:
        assert sample.keys_per_call == (64 // 4 if sample.contender == "span-K4" else 64)
        assert 0 <= sample.inside_us < sample.wall_us
        assert sample.python_us == pytest.approx(sample.wall_us - sample.inside_us)
    table = O.format_overhead({"rows": [O._row(s) for s in samples]})
    for contender in contenders:
        assert f"| null | mla | {O.SMALL} | 64 | {contender} |" in table


def test_a_cell_with_segments_places_every_span_put_on_them():
    with O._listening_port() as port:
        native = O.NullStore()
        config = {"master_server_address": port, "metadata_server": "P2PHANDSHAKE"}
        cell = O.Cell("null", "mla", O.SMALL, 64, ("span-K4",), segments=3)
        rig = O._Rig(cell, native, O._CpuClock(native), config)
        seen: list[str] = []
        put = native.batch_put_from_multi_buffers

        def record(keys, ptrs, sizes, config=None):
            seen.append(config.preferred_segment)
            return put(keys, ptrs, sizes, config)

        native.batch_put_from_multi_buffers = record
        try:
            samples = O._measure(rig, ("span-K4",), reps=1, calls_per_rep=1)
        finally:
            rig.close()
    assert len(samples) == 3
    assert seen and set(seen) <= {f"10.0.0.{i}:15000" for i in range(3)}
    # 16 keys per call over 3 segments: one native put per segment used
    assert len(set(seen)) > 1
    rows = [O._row(s) for s in samples]
    assert {row["segments"] for row in rows} == {3}
    assert "| null (3) | mla |" in O.format_overhead({"rows": rows})
