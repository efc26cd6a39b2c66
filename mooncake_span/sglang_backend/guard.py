"""The one place where sglang-facing calls are kept from raising.

sglang runs storage calls on daemon threads (backup, prefetch, hit queries);
an exception there kills the thread and silently stops the L3 tier. Every
method those threads call is wrapped in :func:`never_raise` with the value it
answers on a miss: bad caller input and cluster failures are logged (rate
limited, naming what is wrong) and become misses; unexpected bugs are logged
with a traceback and become misses too. What happened goes to the backend's
``recorder`` (``recording.py``).
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


def miss_per_key(keys: Any = None, *_args: Any, **_kwargs: Any) -> list[bool]:
    return [False] * _count(keys)


def miss_none_per_key(keys: Any = None, *_args: Any, **_kwargs: Any) -> list[None]:
    return [None] * _count(keys)


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


def miss_count(*_args: Any, **_kwargs: Any) -> int:
    return 0


def miss_flag(*_args: Any, **_kwargs: Any) -> bool:
    return False


def miss_hit_result(*_args: Any, **_kwargs: Any) -> PoolTransferResult:
    return PoolTransferResult(0, {}, [])


def miss_nothing(*_args: Any, **_kwargs: Any) -> None:
    return None
