"""Smoke test of the native multi-buffer batch API that page spans rely on.

A gseg=0 client (this process) writes keys whose value is gathered from K
scattered, out-of-order slices of one registered arena; the bytes live in the
fixture's storage node. Reading back scatters into a zeroed arena with the
same layout, which must then match byte for byte.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

pytestmark = pytest.mark.integration

_KEYS_PER_BATCH = 6
# Varied, not page-aligned sizes catch offset and length mix-ups.
_SLICE_BYTES_CHOICES = (4096, 12_288, 65_536, 1000, 777)
_GAP_BYTES = 512


@pytest.fixture(scope="module")
def store(mooncake_cluster) -> Iterator[object]:
    from mooncake.store import MooncakeDistributedStore

    for name, value in mooncake_cluster.client_env().items():
        os.environ.setdefault(name, value)
    config = mooncake_cluster.client_config()
    client = MooncakeDistributedStore()
    rc = client.setup(
        local_hostname=config["local_hostname"],
        metadata_server=config["metadata_server"],
        global_segment_size=0,
        local_buffer_size=64 << 20,
        protocol=config["protocol"],
        rdma_devices="",
        master_server_addr=config["master_server_address"],
    )
    assert rc == 0, f"setup returned {rc} for {config}"
    yield client
    client.close()


def _scattered_layout(
    rng: np.random.Generator, num_keys: int, buffers_per_key: int
) -> tuple[list[list[int]], list[list[int]], int]:
    """Per-key (offsets, sizes) inside one arena, in shuffled order with gaps.

    Returns (offsets, sizes, arena_bytes). Buffer j of a key is usually not
    adjacent to buffer j+1 and may sit before it in memory.
    """
    sizes = [
        [int(rng.choice(_SLICE_BYTES_CHOICES)) for _ in range(buffers_per_key)]
        for _ in range(num_keys)
    ]
    slots = [(key, j) for key in range(num_keys) for j in range(buffers_per_key)]
    order = rng.permutation(len(slots))
    offsets = [[0] * buffers_per_key for _ in range(num_keys)]
    cursor = 0
    for slot_index in order:
        key, j = slots[slot_index]
        cursor += int(rng.integers(0, _GAP_BYTES))
        offsets[key][j] = cursor
        cursor += sizes[key][j]
    return offsets, sizes, cursor + _GAP_BYTES


@pytest.mark.parametrize("buffers_per_key", [1, 2, 4, 8])
def test_multi_buffer_roundtrip_is_byte_exact(store, key_namespace, buffers_per_key):
    rng = np.random.default_rng(1000 + buffers_per_key)
    offsets, sizes, arena_bytes = _scattered_layout(rng, _KEYS_PER_BATCH, buffers_per_key)
    source = rng.integers(0, 256, arena_bytes, dtype=np.uint8)
    target = np.zeros(arena_bytes, dtype=np.uint8)
    assert store.register_buffer(source.ctypes.data, source.nbytes) == 0
    assert store.register_buffer(target.ctypes.data, target.nbytes) == 0
    try:
        keys = [f"{key_namespace}-k{buffers_per_key}-{i}" for i in range(_KEYS_PER_BATCH)]
        source_ptrs = [[source.ctypes.data + off for off in row] for row in offsets]
        target_ptrs = [[target.ctypes.data + off for off in row] for row in offsets]

        put_rcs = store.batch_put_from_multi_buffers(keys, source_ptrs, sizes)
        # An uninitialised client answers with an empty list, so check the length.
        assert put_rcs == [0] * len(keys)

        assert store.batch_is_exist(keys) == [1] * len(keys)
        assert store.batch_is_exist([f"{key_namespace}-never-written"]) == [0]

        get_rcs = store.batch_get_into_multi_buffers(keys, target_ptrs, sizes)
        assert get_rcs == [sum(row) for row in sizes]
        for key_offsets, key_sizes in zip(offsets, sizes, strict=True):
            for off, size in zip(key_offsets, key_sizes, strict=True):
                np.testing.assert_array_equal(target[off : off + size], source[off : off + size])
        # Gaps between slices stay untouched: the get wrote only where asked.
        written = np.zeros(arena_bytes, dtype=bool)
        for key_offsets, key_sizes in zip(offsets, sizes, strict=True):
            for off, size in zip(key_offsets, key_sizes, strict=True):
                written[off : off + size] = True
        assert not target[~written].any()

        # The stored object is the concatenation of the K slices in key order.
        first_total = sum(sizes[0])
        whole = np.zeros(first_total, dtype=np.uint8)
        assert store.batch_get_into_multi_buffers(
            [keys[0]], [[whole.ctypes.data]], [[first_total]]
        ) == [first_total]
        expected = np.concatenate(
            [source[off : off + size] for off, size in zip(offsets[0], sizes[0], strict=True)]
        )
        np.testing.assert_array_equal(whole, expected)
    finally:
        assert store.unregister_buffer(source.ctypes.data) == 0
        assert store.unregister_buffer(target.ctypes.data) == 0
