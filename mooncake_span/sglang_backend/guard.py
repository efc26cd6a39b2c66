"""``never_raise``: sglang-facing calls answer a miss instead of raising.

Why (sglang's storage threads die on an exception): docs/architecture.md, "How
sglang 0.5.23 drives the backend"; what a wrapped call does: "One
``batch_get_v1``", step 1.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

from mooncake_span.errors import MooncakeSpanError

logger = logging.getLogger(__name__)

Method = TypeVar("Method", bound=Callable[..., Any])


def never_raise(miss: Callable[..., Any]) -> Callable[[Method], Method]:
    """Wrap a method of a backend with a ``recorder`` so that any failure returns
    ``miss(*args, **kwargs)`` instead."""

    def decorate(method: Method) -> Method:
        op_name = method.__name__

        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            failure = None
            try:
                result = method(self, *args, **kwargs)
            except MooncakeSpanError as exc:
                self.recorder.reject(op_name, exc)
                failure = "rejected"
            except Exception:  # a bug must not kill sglang's storage thread
                logger.exception("mooncake-span %s failed unexpectedly", op_name)
                failure = "error"
            if failure is not None:
                result = miss(*args, **kwargs)
            self.recorder.observer.call(op_name, failure, result, time.perf_counter() - started)
            return result

        return guarded  # type: ignore[return-value]

    return decorate


def _count(items: Any) -> int:
    return len(items) if isinstance(items, (list, tuple)) else 0


def _per_key(value: Any) -> Callable[..., list[Any]]:
    """A miss answering ``value`` for every key of the call's first argument."""
    return lambda keys=None, *_args, **_kwargs: [value] * _count(keys)


def _answering(value: Any) -> Callable[..., Any]:
    return lambda *_args, **_kwargs: value


miss_per_key = _per_key(False)
miss_none_per_key = _per_key(None)
miss_count = _answering(0)
miss_flag = _answering(False)
miss_nothing = _answering(None)


def miss_per_transfer(transfers: Any = None, *_args: Any, **_kwargs: Any) -> dict[Any, list[bool]]:
    """``False`` for every key of every transfer whose name can key a dict."""
    out: dict[Any, list[bool]] = {}
    if not isinstance(transfers, (list, tuple)):
        return out
    for transfer in transfers:
        name = getattr(transfer, "name", None)
        try:
            out[name] = [False] * _count(getattr(transfer, "keys", None))
        except TypeError:  # an unhashable name cannot be answered
            continue
    return out


def miss_hit_result(*_args: Any, **_kwargs: Any) -> PoolTransferResult:
    return PoolTransferResult(0, {}, [])
