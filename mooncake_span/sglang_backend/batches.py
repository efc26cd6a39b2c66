"""sglang's call arguments checked and turned into ``PoolBatch`` es.

Every data call starts here: page keys checked, the pool looked up, host
indices turned into host pages (or, on the generic path, flat tensors into
their addresses). A bad argument raises ``InvalidRequestError`` naming the
pool and what is wrong; the guard turns that into a logged miss. One bad
transfer of a v2 call is refused alone, so the others still move.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mooncake_span.errors import InvalidRequestError, MooncakeSpanError
from mooncake_span.sglang_backend.guard import miss_per_transfer
from mooncake_span.sglang_backend.pool_layout import pool_name_str
from mooncake_span.sglang_backend.registration import Registration
from mooncake_span.sglang_backend.stored_pool import PoolBatch, check_host_indices
from mooncake_span.span.geometry import KV_POOL
from mooncake_span.span.keys import check_page_keys

# (operation name, the error) -> None: a refused transfer, counted and logged.
Reject = Callable[[str, Exception], None]


def pool_batch(
    reg: Registration,
    name: str,
    keys: Any,
    host_indices: Any,
    *,
    kv_derived_hint: bool = False,
    extra_info: Any = None,
) -> PoolBatch:
    """One pool's part of a zero-copy call: its keys, host pages and, when
    ``extra_info`` carries prefix keys, where the keys sit in their chain."""
    reg.require_ready()
    pool = reg.registered(name, "transfer")
    page_keys = check_page_keys(keys)
    if not page_keys:
        raise InvalidRequestError(f"pool {name!r}: transfer has no keys")
    chain = reg.chain_of(extra_info, page_keys)
    if pool.is_logical:
        check_host_indices(name, host_indices)
        pages = np.zeros((len(page_keys), 0), dtype=np.int64)
    else:
        kind = reg.kind_of(name, pool, kv_derived_hint)
        pages = pool.host_pages(kind, len(page_keys), host_indices, reg.geometry)
    batch = pool.batch(reg.key_schema, page_keys, pages)
    batch.chain = chain
    return batch


@dataclass
class TransferBatches:
    """A v2 call's transfers as batches; ``results`` starts as a miss for every transfer."""

    results: dict[Any, list[bool]]
    names: list[Any] = field(default_factory=list)  # the result key of each batch
    batches: list[PoolBatch] = field(default_factory=list)


def transfer_batches(
    reg: Registration, op_name: str, transfers: Any, reject: Reject, extra_info: Any = None
) -> TransferBatches:
    """A v2 call's transfers as batches; a transfer refused here is passed to
    ``reject`` and left out (it stays a miss). ``extra_info``'s prefix keys
    precede each transfer's own keys (sglang groups trailing transfers so)."""
    reg.require_ready()
    try:
        transfers = list(transfers or [])
    except TypeError as exc:
        raise InvalidRequestError(
            f"transfers must be a list of PoolTransfer, got {type(transfers).__name__}"
        ) from exc
    out = TransferBatches(miss_per_transfer(transfers))
    for transfer in transfers:
        name = pool_name_str(getattr(transfer, "name", None))
        hint = pool_name_str(getattr(transfer, "indices_from_pool", None)) == KV_POOL
        try:
            batch = pool_batch(
                reg,
                name,
                getattr(transfer, "keys", None),
                getattr(transfer, "host_indices", None),
                kv_derived_hint=hint,
                extra_info=extra_info,
            )
        except MooncakeSpanError as exc:
            reject(op_name, exc)
            continue
        out.names.append(transfer.name)
        out.batches.append(batch)
    return out


def flat_base(index: int, tensor: Any, span_bytes: int) -> int:
    """Address of one generic value: a contiguous CPU tensor of exactly one storage page."""
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
    ):
        raise InvalidRequestError(f"generic value #{index} must be a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != span_bytes:
        raise InvalidRequestError(
            f"generic value #{index} holds {nbytes} bytes; a storage page is {span_bytes} bytes"
        )
    return tensor.data_ptr()


def span_bytes(reg: Registration) -> int:
    """Bytes of one storage key's KV: a generic value's size."""
    return reg.pools[KV_POOL].layout.flat_page_bytes * reg.geometry.pages_per_span


def flat_batch(reg: Registration, keys: Any, tensors: Sequence[Any]) -> PoolBatch:
    """A KV batch whose objects come from one flat span tensor per key (generic path)."""
    reg.require_ready()
    kv = reg.pools[KV_POOL]
    page_keys = check_page_keys(keys)
    if len(tensors) != len(page_keys):
        raise InvalidRequestError(f"{len(page_keys)} keys but {len(tensors)} tensors")
    pages = np.zeros((len(page_keys), reg.geometry.pages_per_span), dtype=np.int64)
    batch = kv.batch(reg.key_schema, page_keys, pages)
    if not kv.is_logical:
        size = span_bytes(reg)
        batch.flat_bases = [flat_base(i, t, size) for i, t in enumerate(tensors)]
    return batch
