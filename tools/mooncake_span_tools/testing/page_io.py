"""Pages of real host pools as bytes: allocate, fill, wipe, read and compare them.

Two ways in, for two needs. Through sglang's flat-page API
(``set_from_flat_data_page`` / ``get_data_page``): works for every pool, and a
page's bytes are reproducible from a seed and its slot, which the tests and the
demo rely on. Through the zero-copy pointers of a pool's ``PageLayout``
(``slot_views``, ``fill_random_rows``, ``wipe_rows``, ``rows_equal``): numpy
views and memset/memcmp over many pages at once, which is what keeps the
benchmark's preparation and byte-exact check off its clock budget.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
from sglang.srt.mem_cache.pool_host.base import HostKVCache

from mooncake_span.span.plan import PageLayout

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# page bytes
# ---------------------------------------------------------------------------


def alloc_pages(host_pool: HostKVCache, pages: int) -> torch.Tensor:
    """Allocate ``pages`` host pages; returns their slot indices (pages * page_size)."""
    slots = host_pool.alloc(pages * host_pool.page_size)
    if slots is None:
        raise MemoryError(
            f"{type(host_pool).__name__} has {host_pool.available_size()} free slots, "
            f"{pages} pages of {host_pool.page_size} requested"
        )
    return slots


def page_starts(host_pool: HostKVCache, slots: torch.Tensor | Sequence[int]) -> list[int]:
    """The first slot of each page in ``slots`` (a page-aligned slot list)."""
    values = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
    if len(values) % host_pool.page_size:
        raise ValueError(
            f"{len(values)} slots is not a whole number of {host_pool.page_size}-slot pages"
        )
    return [int(v) for v in values[:: host_pool.page_size]]


def _page_seed(seed: int, slot: int) -> int:
    # Distinct bytes per page (so a page restored at the wrong slot is caught),
    # reproducible per (seed, slot).
    return (seed * 1_000_003 + slot) & 0x7FFF_FFFF_FFFF_FFFF


def fill_random_pages(host_pool: HostKVCache, starts: Iterable[int], seed: int) -> None:
    """Overwrite each page (given by its first slot) with random bytes."""
    template = host_pool.get_dummy_flat_data_page()
    for slot in starts:
        generator = torch.Generator().manual_seed(_page_seed(seed, int(slot)))
        raw = torch.randint(0, 256, (template.nbytes,), dtype=torch.uint8, generator=generator)
        host_pool.set_from_flat_data_page(int(slot), raw.view(template.dtype))


def wipe_pages(host_pool: HostKVCache, starts: Iterable[int]) -> None:
    """Zero each page (given by its first slot)."""
    zeros = host_pool.get_dummy_flat_data_page()
    for slot in starts:
        host_pool.set_from_flat_data_page(int(slot), zeros)


def page_bytes(host_pool: HostKVCache, slot: int) -> bytes:
    """The flat page at ``slot`` as sglang serialises it (``get_data_page(flat=True)``)."""
    page = host_pool.get_data_page(int(slot), flat=True)
    return page.contiguous().view(torch.uint8).numpy().tobytes()


def meta_page_bytes(host_pool: HostKVCache, slot: int) -> bytes:
    """The page at ``slot`` read through the zero-copy pointers of
    ``get_page_buffer_meta``, concatenated in pointer order.

    Equals ``page_bytes`` for every pool and layout except MHA layer_first,
    whose pointers interleave K and V per layer while the flat page is all K
    layers then all V layers.
    """
    slots = torch.arange(int(slot), int(slot) + host_pool.page_size, dtype=torch.int64)
    ptrs, sizes = host_pool.get_page_buffer_meta(slots)
    return b"".join(ctypes.string_at(ptr, size) for ptr, size in zip(ptrs, sizes, strict=True))


# ---------------------------------------------------------------------------
# many pages at once, through a pool's zero-copy pointers
# ---------------------------------------------------------------------------

# Rows filled per numpy call: large enough to amortise the call, small enough
# that the random bytes of one chunk stay in cache.
FILL_CHUNK_BYTES = 64 << 20


def _slot_ids(layout: PageLayout) -> list[int]:
    return sorted({s for comp in layout.components for s in comp})


def slot_views(layout: PageLayout) -> list[np.ndarray]:
    """Strided uint8 views ``view[page] = bytes of (page, slot)`` over the pool's memory."""
    views = []
    for b in _slot_ids(layout):
        size, stride = layout.slot_bytes[b], layout.page_stride_bytes[b]
        extent = (layout.num_pages - 1) * stride + size
        flat = np.frombuffer(
            (ctypes.c_uint8 * extent).from_address(layout.base_ptrs[b]), dtype=np.uint8
        )
        views.append(np.lib.stride_tricks.as_strided(flat, (layout.num_pages, size), (stride, 1)))
    return views


def fill_random_rows(
    views: Sequence[np.ndarray],
    rows: np.ndarray,
    rng: np.random.Generator,
    chunk_bytes: int = FILL_CHUNK_BYTES,
) -> None:
    """Random bytes into pages ``rows`` of every view, a chunk of rows at a time."""
    for view in views:
        step = max(1, chunk_bytes // max(view.shape[1], 1))
        for start in range(0, len(rows), step):
            chunk = rows[start : start + step]
            view[chunk] = rng.integers(0, 256, size=(len(chunk), view.shape[1]), dtype=np.uint8)


_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def _slot_addresses(layout: PageLayout, rows: np.ndarray) -> Iterator[tuple[list[int], int]]:
    for b in _slot_ids(layout):
        addrs = layout.base_ptrs[b] + rows.astype(np.int64) * layout.page_stride_bytes[b]
        yield addrs.tolist(), layout.slot_bytes[b]


def wipe_rows(layout: PageLayout, rows: np.ndarray) -> None:
    """Zero every slot of pages ``rows``."""
    for addrs, size in _slot_addresses(layout, rows):
        for addr in addrs:
            ctypes.memset(addr, 0, size)


def rows_equal(layout: PageLayout, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: are all slots of page ``a[i]`` byte-equal to those of ``b[i]`` (memcmp)."""
    out = np.ones(len(a), dtype=bool)
    for (xs, size), (ys, _) in zip(
        _slot_addresses(layout, a), _slot_addresses(layout, b), strict=True
    ):
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if _memcmp(x, y, size):
                out[i] = False
    return out
