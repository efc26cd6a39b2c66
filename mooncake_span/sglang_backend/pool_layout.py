"""Turn an sglang host pool into what the pure planner needs, once at registration.

Per pool: its stored components with their key suffixes and rank scopes (an
MHA-style pool's k and v form one ``kv`` object: docs/span-format.md, "Group
ids"), an affine address model ``ptr(page, slot) = base + page * stride``
fitted to ``get_page_buffer_meta`` and checked on more pages (so per-call
planning needs no Python loop over sglang's per-page code), and the buffers
to register. Zero-byte slots are left out of the pointers (Mooncake rejects
0-byte buffers).
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from mooncake_span.errors import RegistrationError
from mooncake_span.span.geometry import KV_DERIVED_POOLS, KV_POOL
from mooncake_span.span.keys import ComponentSpec, RankScope
from mooncake_span.span.plan import PageLayout

R = RankScope.REPLICATED
S = RankScope.SHARDED


def pool_name_str(name: Any) -> str:
    """sglang's PoolName / PoolHitPolicy are str enums; accept either form."""
    return str(getattr(name, "value", name))


@dataclass(frozen=True)
class PoolShape:
    page_tokens: int
    components: tuple[ComponentSpec, ...]
    layout: PageLayout | None
    buffers: tuple[tuple[int, int], ...]
    # No zero-copy pointers (the DSA indexer in layer_first): pages are copied
    # through the staging arena, and ``layout`` describes one flat page.
    staged: bool = False


# sglang host-pool classes told apart by type, imported only when asked.
_SGLANG_POOLS = {
    "mla": ("sglang.srt.mem_cache.pool_host.mla", "MLATokenToKVPoolHost"),
    "mha": ("sglang.srt.mem_cache.pool_host.mha", "MHATokenToKVPoolHost"),
    "dsv4": ("sglang.srt.mem_cache.memory_pool_host", "DeepSeekV4PagedHostPool"),
    # DeepSeek-V4's anchor: page slots and no KV bytes (its sidecars hold them).
    "logical_anchor": ("sglang.srt.mem_cache.memory_pool_host", "LogicalHostPool"),
}


def _is(pool: Any, kind: str) -> bool:
    module, cls = _SGLANG_POOLS[kind]
    try:
        return isinstance(pool, getattr(importlib.import_module(module), cls))
    except (ImportError, AttributeError):
        return False


def component_specs(name: str, pool: Any, *, is_mla: bool) -> tuple[ComponentSpec, ...]:
    if name == KV_POOL:
        return (ComponentSpec("k", R),) if is_mla else (ComponentSpec("kv", S, parts=2),)
    if name == "mamba":
        convs = len(getattr(pool, "conv_buffer", None) or [])
        specs = [ComponentSpec(f"conv_{i}", S) for i in range(convs)]
        if getattr(pool, "temporal_state_elem_size", 1) > 0:
            specs.insert(0, ComponentSpec("temporal", S))
        return tuple(specs)
    if name == "draft":
        if _is(pool, "mla"):
            return (ComponentSpec("draft_k", R),)
        return (ComponentSpec("draft_kv", S, parts=2),)
    if name == "draft_swa":
        if _is(pool, "mla") or _is(pool, "dsv4"):
            return (ComponentSpec("draft_swa", R),)
        if _is(pool, "mha"):
            return (ComponentSpec("draft_swa_kv", S, parts=2),)
    if name == "swa":
        if not is_mla and hasattr(pool, "v_buffer"):
            return (ComponentSpec("swa_kv", S, parts=2),)
        if is_mla:
            return (ComponentSpec("swa", R),)
    if name in KV_DERIVED_POOLS or name.startswith("deepseek_v4_"):
        return (ComponentSpec(name, R),)
    raise RegistrationError(
        f"pool {name!r} ({type(pool).__name__}) has no Mooncake object layout in mooncake-span "
        "(supported: kv, indexer, draft, draft_indexer, draft_swa, swa, mamba, deepseek_v4_*)"
    )


def _page_meta(pool: Any, page: int, page_tokens: int) -> tuple[list[int], list[int]]:
    indices = torch.arange(page * page_tokens, (page + 1) * page_tokens, dtype=torch.int64)
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def fit_page_layout(
    name: str, pool: Any, page_tokens: int, parts: tuple[int, ...] = (1,)
) -> PageLayout:
    """Fit ``ptr = base + page * stride`` per slot and verify it on more pages.

    ``parts``: per stored component, how many of sglang's pointer groups it packs."""
    num_components = sum(parts)
    num_pages = _host_pages(name, pool, page_tokens)
    try:
        base, sizes = _page_meta(pool, 0, page_tokens)
        samples = sorted({1, num_pages // 2, num_pages - 1} - {0})
        metas = {p: _page_meta(pool, p, page_tokens) for p in samples if p < num_pages}
    except (NotImplementedError, ValueError, AssertionError, AttributeError) as exc:
        raise RegistrationError(
            f"pool {name!r} ({type(pool).__name__}, layout {getattr(pool, 'layout', '?')}) "
            f"offers no zero-copy page pointers (get_page_buffer_meta failed: {exc}); a pool "
            "without them needs get_dummy_flat_data_page, get_data_page and "
            "set_from_flat_data_page to be copied through staging"
        ) from exc
    if not base:
        raise RegistrationError(f"pool {name!r}: get_page_buffer_meta returned no buffers")
    strides = [0] * len(base)
    if 1 in metas:
        strides = [p1 - p0 for p0, p1 in zip(base, metas[1][0], strict=False)]
    for page, (ptrs, page_sizes) in metas.items():
        predicted = [b + page * s for b, s in zip(base, strides, strict=False)]
        if page_sizes != sizes or ptrs != predicted:
            raise RegistrationError(
                f"pool {name!r}: page pointers are not an affine function of the page index "
                f"(page {page}); this host pool layout is not supported"
            )
    if len(base) % num_components:
        raise RegistrationError(
            f"pool {name!r}: {len(base)} buffers per page cannot be split into "
            f"{num_components} components"
        )
    # sglang emits per page [g0, g1, ...] per layer (MHA layer_first: K0,V0,K1,V1):
    # pointer group g owns every num_components-th buffer.
    groups = [
        tuple(b for b in range(c, len(base), num_components) if sizes[b] > 0)
        for c in range(num_components)
    ]
    # A packed component takes its groups whole and in order (MHA: every k
    # slot, then every v slot), the order of sglang's flat page.
    components = tuple(
        sum(groups[end - count : end], ())
        for end, count in zip(itertools.accumulate(parts), parts, strict=True)
    )
    if empty := [c for c, slots in enumerate(components) if not slots]:
        raise RegistrationError(
            f"pool {name!r}: component(s) {empty} have no bytes per page (every buffer "
            "get_page_buffer_meta gives for them is 0 bytes); Mooncake stores no 0-byte object"
        )
    return PageLayout(
        base_ptrs=tuple(base),
        page_stride_bytes=tuple(strides),
        slot_bytes=tuple(sizes),
        components=components,
        num_pages=num_pages,
    )


def _host_pages(name: str, pool: Any, page_tokens: int) -> int:
    num_pages = int(getattr(pool, "size", 0) or 0) // page_tokens
    if num_pages < 1:
        raise RegistrationError(
            f"pool {name!r} ({type(pool).__name__}) has no host pages: size "
            f"{getattr(pool, 'size', None)!r} tokens with {page_tokens}-token pages"
        )
    return num_pages


def _flat_page_layout(name: str, pool: Any, page_tokens: int) -> PageLayout:
    num_pages = _host_pages(name, pool, page_tokens)
    dummy = pool.get_dummy_flat_data_page()
    flat_bytes = dummy.numel() * dummy.element_size()
    return PageLayout(
        base_ptrs=(0,),
        page_stride_bytes=(flat_bytes,),
        slot_bytes=(flat_bytes,),
        components=((0,),),
        num_pages=num_pages,
    )


def _registration_buffers(pool: Any) -> tuple[tuple[int, int], ...]:
    try:
        tensors = list(pool.get_hybrid_pool_buffer())
    except (AttributeError, NotImplementedError):
        tensors = [getattr(pool, "kv_buffer", None)]
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > 0:
            seen[tensor.data_ptr()] = max(nbytes, seen.get(tensor.data_ptr(), 0))
    return tuple(seen.items())


def describe_pool(name: str, pool: Any, *, is_mla: bool) -> PoolShape:
    page_tokens = int(getattr(pool, "page_size", 0) or 1)
    specs = component_specs(name, pool, is_mla=is_mla)
    if name == KV_POOL and _is(pool, "logical_anchor"):
        return PoolShape(page_tokens, specs, None, ())
    try:
        layout = fit_page_layout(name, pool, page_tokens, tuple(s.parts for s in specs))
    except RegistrationError:
        if [s.parts for s in specs] != [1] or not _stages_pages(pool):
            raise
        layout = _flat_page_layout(name, pool, page_tokens)
        return PoolShape(page_tokens, specs, layout, (), staged=True)
    buffers = _registration_buffers(pool)
    _check_registered(name, layout, buffers)
    return PoolShape(page_tokens, specs, layout, buffers)


def _stages_pages(pool: Any) -> bool:
    return all(
        callable(getattr(pool, method, None))
        for method in ("get_dummy_flat_data_page", "get_data_page", "set_from_flat_data_page")
    )


def _check_registered(name: str, layout: PageLayout, buffers: tuple[tuple[int, int], ...]) -> None:
    """Every page slot the zero-copy calls will name lies inside a buffer registered with
    Mooncake (RDMA's rule; TCP would not notice)."""
    last = layout.num_pages - 1
    for slot, (base, stride, size) in enumerate(
        zip(layout.base_ptrs, layout.page_stride_bytes, layout.slot_bytes, strict=True)
    ):
        if size == 0:
            continue
        lo, hi = min(base, base + last * stride), max(base, base + last * stride) + size
        if not any(start <= lo and hi <= start + length for start, length in buffers):
            raise RegistrationError(
                f"pool {name!r}: page slot {slot} ({lo:#x}..{hi:#x}) lies outside the buffers "
                "it offers for registration (get_hybrid_pool_buffer, or kv_buffer); Mooncake "
                "can only move registered memory"
            )
