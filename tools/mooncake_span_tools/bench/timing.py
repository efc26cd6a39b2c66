"""A proxy that times chosen methods of the object it wraps.

The benchmark wraps the native Mooncake client with it (native seconds per
call, so "Python time" = wall - native), and the namespace tests' node worker
wraps the backend with it (each sglang-facing call's duration, and any
exception, which the backend promises never to raise). Standard library only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["CallRecord", "TimedProxy"]

# (method name, positional arguments, wall-clock start, seconds, exception or None)
CallRecord = tuple[str, tuple[Any, ...], float, float, BaseException | None]


class TimedProxy:
    """Forwards every attribute to ``target``; calls to the methods named in
    ``timed`` are timed and reported to ``on_call`` after they return or raise
    (an exception is reported, then re-raised).

    Methods a subclass defines itself are not forwarded. The timing wrapper
    of a method is built on first use and cached on the instance, so a hot
    loop pays one closure call per call and nothing else.
    """

    def __init__(
        self,
        target: Any,
        timed: Iterable[str],
        on_call: Callable[[str, tuple[Any, ...], float, float, BaseException | None], None],
    ) -> None:
        self._target = target
        self._timed = frozenset(timed)
        self._on_call = on_call

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            # Private names never reach the target: also keeps __getattr__ from
            # recursing before __init__ has set _target (copy, pickle).
            raise AttributeError(name)
        attr = getattr(self._target, name)
        if name not in self._timed:
            return attr
        on_call = self._on_call

        def timed(*args: Any, **kwargs: Any) -> Any:
            wall_s = time.time()
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                return attr(*args, **kwargs)
            except BaseException as exc:
                error = exc
                raise
            finally:
                on_call(name, args, wall_s, time.perf_counter() - started, error)

        self.__dict__[name] = timed
        return timed
