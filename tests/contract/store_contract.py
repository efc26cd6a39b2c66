"""The native store API as ``mooncake_span.store.client.MooncakeClient`` uses it.

``StoreContract`` is run twice: against ``FakeStore`` (tests/unit) and against
a real Mooncake cluster (tests/integration). Passing both is what entitles the
unit tests to trust the fake. The cases sit at the ``MooncakeClient`` level,
the layer unit tests fake, so they pin the conventions the backend relies on:
per-key booleans, put keeps an existing value, a get succeeds only when it
fills exactly the object, duplicate keys and over-budget batches work.

A subclass provides a ``make_client`` fixture: ``make_client(options=None,
*, fresh=False)`` returns a connected ``MooncakeClient`` (``SpanOptions()``
when options is None). Without ``fresh`` it may hand out a client shared with
other tests of the class (closing a real client takes about a second); with
``fresh=True`` the client is the caller's alone (a test may close it). The
subclass closes every client it made exactly once.

Registered arenas live as long as the test class: ``MooncakeClient`` cannot
unregister memory, so an arena must not be freed while a client that
registered it is still open.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mooncake_span.config import SpanOptions
from mooncake_span.errors import StoreClosedError
from mooncake_span.span.plan import ObjectPlan
from mooncake_span.store.client import MooncakeClient

# Varied, not page-aligned sizes catch offset and length mix-ups.
_SLICE_SIZES = (4096, 1000, 777, 12_288, 64)
_GAP = 256


def random_sizes(
    rng: np.random.Generator, num_objects: int, buffers_per_object: int
) -> list[list[int]]:
    return [
        [int(rng.choice(_SLICE_SIZES)) for _ in range(buffers_per_object)]
        for _ in range(num_objects)
    ]


def scattered_slices(
    rng: np.random.Generator, sizes: list[list[int]]
) -> tuple[list[list[tuple[int, int]]], int]:
    """Per object, one (offset, size) slice of an arena per entry of ``sizes``.

    Slices are placed in shuffled order with random gaps, so buffer j+1 of an
    object is usually not next to buffer j and may sit before it. Returns the
    slices and the arena size they need.
    """
    cells = [(o, j) for o, row in enumerate(sizes) for j in range(len(row))]
    slices: list[list[tuple[int, int]]] = [[(0, 0)] * len(row) for row in sizes]
    cursor = _GAP
    for index in rng.permutation(len(cells)):
        o, j = cells[int(index)]
        slices[o][j] = (cursor, sizes[o][j])
        cursor += sizes[o][j] + int(rng.integers(1, _GAP))
    return slices, cursor + _GAP


def plan_at(arena: np.ndarray, slices: list[tuple[int, int]]) -> ObjectPlan:
    base = arena.ctypes.data
    return ObjectPlan([base + off for off, _ in slices], [size for _, size in slices])


def slice_bytes(arena: np.ndarray, slices: list[tuple[int, int]]) -> bytes:
    """The object an arena's slices make, read with plain indexing."""
    return b"".join(arena[off : off + size].tobytes() for off, size in slices)


def plan_bytes(plan: ObjectPlan) -> bytes:
    return b"".join(ctypes.string_at(p, s) for p, s in zip(plan.ptrs, plan.sizes, strict=True))


class StoreContract:
    """Mixin of contract cases; not collected by itself (no ``Test`` prefix)."""

    @pytest.fixture
    def make_client(self):  # pragma: no cover - every subclass overrides it
        raise NotImplementedError("a StoreContract subclass must provide make_client")

    @pytest.fixture(scope="class", autouse=True)
    def _arena_keepalive(self):
        # An autouse fixture is set up before, and torn down after, the other
        # fixtures of its scope: arenas outlive the clients that registered them.
        arenas: list[np.ndarray] = []
        yield arenas
        arenas.clear()

    @pytest.fixture(autouse=True)
    def _bind_arenas(self, _arena_keepalive):
        self._arenas = _arena_keepalive

    def arena(self, client: MooncakeClient, nbytes: int, *, seed: int | None = None) -> np.ndarray:
        """A registered arena: random bytes when seeded, zeros otherwise."""
        if seed is None:
            array = np.zeros(nbytes, dtype=np.uint8)
        else:
            array = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        client.register_buffer(array.ctypes.data, array.nbytes)
        self._arenas.append(array)
        return array

    def put_objects(
        self, client: MooncakeClient, keys: list[str], buffers: int = 4, *, seed: int = 0
    ) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
        rng = np.random.default_rng(seed)
        slices, nbytes = scattered_slices(rng, random_sizes(rng, len(keys), buffers))
        source = self.arena(client, nbytes, seed=seed + 1)
        assert client.put(keys, [plan_at(source, s) for s in slices]) == [True] * len(keys)
        return source, slices

    # -- cases ------------------------------------------------------------------

    def test_placement_puts_a_domain_on_one_listed_segment(
        self, make_client, placement_options, key_namespace
    ):
        # What failure domains rely on: the segment list names the segments
        # that preferred_segment accepts and that batch_get_replica_desc reports.
        client = make_client(placement_options, fresh=True)
        segments = client.segments()
        assert segments, "placement found no segment list"
        client.place_by(lambda key: key.rsplit("-", 1)[0])
        keys = [f"{key_namespace}.dom-{component}" for component in ("k", "indexer", "conv_0")]
        self.put_objects(client, keys, 2, seed=61)
        located = client.locate(keys)
        homes = {segment for key in keys for segment in located.get(key, ())}
        assert sorted(located) == sorted(keys)
        assert len(homes) == 1 and homes <= set(segments), (homes, segments)

    @pytest.mark.parametrize("buffers", [1, 4, 9])
    def test_put_exists_get_multi_buffer_byte_exact(self, make_client, key_namespace, buffers):
        client = make_client()
        keys = [f"{key_namespace}-rt{buffers}-{i}" for i in range(5)]
        source, slices = self.put_objects(client, keys, buffers, seed=buffers)

        assert client.exists(keys + [f"{key_namespace}-never"]) == [True] * 5 + [False]

        # Read back into a different scattered layout of the same sizes.
        rng = np.random.default_rng(100 + buffers)
        sizes = [[size for _, size in row] for row in slices]
        target_slices, nbytes = scattered_slices(rng, sizes)
        target = self.arena(client, nbytes)
        assert client.get(keys, [plan_at(target, s) for s in target_slices]) == [True] * 5
        for src, dst in zip(slices, target_slices, strict=True):
            assert slice_bytes(target, dst) == slice_bytes(source, src)
        # Only the planned bytes were written.
        written = np.zeros(nbytes, dtype=bool)
        for row in target_slices:
            for off, size in row:
                written[off : off + size] = True
        assert not target[~written].any()

        # The stored object is the buffers' concatenation in plan order.
        whole_size = sum(sizes[0])
        whole = self.arena(client, whole_size)
        assert client.get([keys[0]], [ObjectPlan([whole.ctypes.data], [whole_size])]) == [True]
        assert whole.tobytes() == slice_bytes(source, slices[0])

    def test_get_missing_key_is_false(self, make_client, key_namespace):
        client = make_client()
        present = [f"{key_namespace}-p0", f"{key_namespace}-p1"]
        source, slices = self.put_objects(client, present, 2, seed=7)
        sizes = [sum(size for _, size in row) for row in slices]
        missing = f"{key_namespace}-missing"
        # Positions: present[0], missing (planned like present[1]), present[1].
        layout = [sizes[0], sizes[1], sizes[1]]
        offsets = [sum(layout[:i]) for i in range(3)]
        target = self.arena(client, sum(layout))
        plans = [
            ObjectPlan([target.ctypes.data + o], [n]) for o, n in zip(offsets, layout, strict=True)
        ]
        assert client.get([present[0], missing, present[1]], plans) == [True, False, True]
        assert plan_bytes(plans[0]) == slice_bytes(source, slices[0])
        assert plan_bytes(plans[2]) == slice_bytes(source, slices[1])
        # Nothing was written for the missing key.
        assert not any(plan_bytes(plans[1]))
        assert client.get([missing], [plans[1]]) == [False]

    def test_put_of_existing_key_reports_success_and_keeps_the_old_value(
        self, make_client, key_namespace
    ):
        client = make_client()
        key = f"{key_namespace}-dup"
        old = self.arena(client, 4096, seed=1)
        new = self.arena(client, 4096, seed=2)
        assert old.tobytes() != new.tobytes()
        assert client.put([key], [ObjectPlan([old.ctypes.data], [4096])]) == [True]
        assert client.put([key], [ObjectPlan([new.ctypes.data], [4096])]) == [True]
        target = self.arena(client, 4096)
        assert client.get([key], [ObjectPlan([target.ctypes.data], [4096])]) == [True]
        assert target.tobytes() == old.tobytes()

    def test_duplicate_keys_in_one_put_batch(self, make_client, key_namespace):
        client = make_client()
        key = f"{key_namespace}-twice"
        first = self.arena(client, 2048, seed=3)
        second = self.arena(client, 2048, seed=4)
        plans = [ObjectPlan([first.ctypes.data], [2048]), ObjectPlan([second.ctypes.data], [2048])]
        assert client.put([key, key], plans) == [True, True]
        target = self.arena(client, 2048)
        assert client.get([key], [ObjectPlan([target.ctypes.data], [2048])]) == [True]
        # The first occurrence is the one written.
        assert target.tobytes() == first.tobytes()

    @pytest.mark.parametrize("delta", [-1, +1, -512])
    def test_get_with_wrong_total_size_fails_whole(self, make_client, key_namespace, delta):
        client = make_client()
        key = f"{key_namespace}-sized"
        source = self.arena(client, 4096, seed=5)
        assert client.put(
            [key], [ObjectPlan([source.ctypes.data, source.ctypes.data + 3000], [1000, 1096])]
        ) == [True]
        target = self.arena(client, 8192)
        wrong = ObjectPlan([target.ctypes.data, target.ctypes.data + 4096], [2048, 2048 + delta])
        assert client.get([key], [wrong]) == [False]
        # A correct read afterwards still works: the failure was per key only.
        right = self.arena(client, 2096)
        assert client.get([key], [ObjectPlan([right.ctypes.data], [2096])]) == [True]
        assert right.tobytes() == source[:1000].tobytes() + source[3000:4096].tobytes()
        assert client.stats()["breaker_state"] == "closed"

    def test_get_into_too_small_buffers_is_a_request_error_not_a_transport_failure(
        self, make_client, key_namespace
    ):
        # Mooncake answers INVALID_PARAMS (-600) when the buffers cannot hold
        # the object: the request was wrong, the cluster is fine, so the
        # breaker must not count it.
        client = make_client()
        key = f"{key_namespace}-small"
        source = self.arena(client, 4096, seed=6)
        assert client.put([key], [ObjectPlan([source.ctypes.data], [4096])]) == [True]
        before = client.stats()["error_counts"].get("INVALID_PARAMS", 0)
        target = self.arena(client, 4096)
        assert client.get([key], [ObjectPlan([target.ctypes.data], [4095])]) == [False]
        stats = client.stats()
        assert stats["error_counts"].get("INVALID_PARAMS", 0) == before + 1
        assert stats["breaker_consecutive_failures"] == 0
        # Nothing was written: there is no partial success.
        assert not target.any()

    def test_empty_key_is_rejected(self, make_client):
        client = make_client()
        arena = self.arena(client, 64, seed=8)
        assert client.put([""], [ObjectPlan([arena.ctypes.data], [64])]) == [False]

    def test_duplicate_keys_in_one_get_batch_fill_every_position(self, make_client, key_namespace):
        client = make_client()
        keys = [f"{key_namespace}-a", f"{key_namespace}-b"]
        source, slices = self.put_objects(client, keys, 3, seed=11)
        sizes = [[s for _, s in row] for row in slices]
        order = [0, 1, 0, 0, 1]
        target_slices = []
        cursor = 0
        for obj in order:
            row = []
            for size in sizes[obj]:
                row.append((cursor, size))
                cursor += size + 13
            target_slices.append(row)
        target = self.arena(client, cursor)
        result = client.get(
            [keys[o] for o in order], [plan_at(target, row) for row in target_slices]
        )
        assert result == [True] * len(order)
        for obj, row in zip(order, target_slices, strict=True):
            assert slice_bytes(target, row) == slice_bytes(source, slices[obj])

    def test_batches_over_the_buffer_budget_succeed_for_every_key(self, make_client, key_namespace):
        client = make_client(SpanOptions(max_buffers_per_call=8))
        # 7 objects x 4 buffers = 28 buffers: at least 4 native calls.
        keys = [f"{key_namespace}-budget-{i}" for i in range(7)]
        source, slices = self.put_objects(client, keys, 4, seed=21)
        # One object alone larger than the budget travels in its own call.
        big_key = f"{key_namespace}-budget-big"
        big_source, big_slices = self.put_objects(client, [big_key], 12, seed=22)
        all_keys = keys + [big_key]
        all_slices = slices + big_slices
        assert client.exists(all_keys) == [True] * len(all_keys)
        sizes = [[s for _, s in row] for row in all_slices]
        cursor = 0
        target_slices = []
        for row_sizes in sizes:
            target_slices.append(
                [(cursor + 7 * j + sum(row_sizes[:j]), s) for j, s in enumerate(row_sizes)]
            )
            cursor = target_slices[-1][-1][0] + row_sizes[-1] + 64
        target = self.arena(client, cursor)
        assert client.get(all_keys, [plan_at(target, row) for row in target_slices]) == [
            True
        ] * len(all_keys)
        for index, row in enumerate(target_slices):
            src_arena = source if index < len(keys) else big_source
            assert slice_bytes(target, row) == slice_bytes(src_arena, all_slices[index])

    def test_empty_batches(self, make_client):
        client = make_client()
        assert client.exists([]) == []
        assert client.put([], []) == []
        assert client.get([], []) == []

    def test_zero_byte_object_is_rejected(self, make_client, key_namespace):
        client = make_client()
        arena = self.arena(client, 64, seed=9)
        key = f"{key_namespace}-empty"
        assert client.put([key], [ObjectPlan([arena.ctypes.data], [0])]) == [False]
        assert client.exists([key]) == [False]

    def test_remove_prefix_removes_only_matching_keys(self, make_client, key_namespace):
        client = make_client()
        doomed = [f"{key_namespace}.a-1", f"{key_namespace}.a-2"]
        # "." must be literal and the match anchored at the start.
        survivors = [f"{key_namespace}Xa-1", f"{key_namespace}.b-1", f"z{key_namespace}.a-3"]
        self.put_objects(client, doomed + survivors, 1, seed=31)
        assert client.remove_prefix(f"{key_namespace}.a") == 2
        assert client.exists(doomed + survivors) == [False, False, True, True, True]

    def test_remove(self, make_client, key_namespace):
        client = make_client()
        keys = [f"{key_namespace}-r0", f"{key_namespace}-r1"]
        self.put_objects(client, keys, 1, seed=41)
        assert client.remove([keys[0], f"{key_namespace}-missing"]) == 1
        assert client.exists(keys) == [False, True]

    def test_every_method_raises_after_close(self, make_client, key_namespace):
        client = make_client(fresh=True)
        arena = self.arena(client, 128, seed=51)
        plan = ObjectPlan([arena.ctypes.data], [128])
        key = f"{key_namespace}-closed"
        assert client.put([key], [plan]) == [True]
        client.close()
        assert client.closed
        calls = {
            "exists": lambda: client.exists([key]),
            "put": lambda: client.put([key], [plan]),
            "get": lambda: client.get([key], [plan]),
            "remove": lambda: client.remove([key]),
            "remove_all": lambda: client.remove_all(),
            "remove_prefix": lambda: client.remove_prefix(key_namespace),
            "register_buffer": lambda: client.register_buffer(arena.ctypes.data, 128),
        }
        for name, call in calls.items():
            with pytest.raises(StoreClosedError):
                call()
                pytest.fail(f"{name} did not raise after close()")
        # close() is idempotent and stats() stays readable for diagnostics.
        client.close()
        assert isinstance(client.stats()["error_counts"], dict)

    def test_stats_count_object_not_found(self, make_client, key_namespace):
        client = make_client()
        before = client.stats()["error_counts"].get("OBJECT_NOT_FOUND", 0)
        target = self.arena(client, 256)
        plan = ObjectPlan([target.ctypes.data], [256])
        assert client.get([f"{key_namespace}-nf-0"], [plan]) == [False]
        assert client.get([f"{key_namespace}-nf-1", f"{key_namespace}-nf-2"], [plan, plan]) == [
            False,
            False,
        ]
        stats = client.stats()
        assert stats["error_counts"].get("OBJECT_NOT_FOUND", 0) == before + 3
        # A miss is an answer: it must not count against the breaker.
        assert stats["breaker_state"] == "closed"
        assert stats["breaker_consecutive_failures"] == 0
