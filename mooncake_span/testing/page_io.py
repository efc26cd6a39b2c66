"""Page-level helpers on real host pools: allocate, fill, wipe and read pages as bytes."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable, Sequence

import torch
from sglang.srt.mem_cache.pool_host.base import HostKVCache

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
