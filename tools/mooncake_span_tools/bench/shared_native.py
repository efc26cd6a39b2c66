"""The one native Mooncake client a benchmark topology shares, timed alike for every contender,
and the recording wrapper the benchmarks that count objects put around a client."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from mooncake_span.config import SpanOptions
from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.store.client import native_env_defaults
from mooncake_span_tools.bench.timing import TimedProxy
from mooncake_span_tools.bench.workloads import BenchConfig, MiB

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# the shared native client


@dataclass
class NativeCounters:
    io_s: float = 0.0
    io_calls: int = 0
    io_objects: int = 0
    io_buffers: int = 0
    exist_s: float = 0.0
    exist_calls: int = 0
    exist_keys: int = 0

    def minus(self, other: NativeCounters) -> NativeCounters:
        return NativeCounters(**{k: getattr(self, k) - getattr(other, k) for k in asdict(self)})


def _buffer_count(name: str, args: tuple[Any, ...]) -> int:
    ptrs = args[1]
    return sum(map(len, ptrs)) if name.endswith("_multi_buffers") else len(ptrs)


_IO_CALLS = (
    "batch_put_from_multi_buffers",
    "batch_get_into_multi_buffers",
    "batch_put_from",
    "batch_get_into",
)


def raw_client(client_config: Mapping[str, Any], segment_bytes: int = 0) -> Any:
    """A bare ``MooncakeDistributedStore`` of the cluster an sglang-style client
    config names (TCP, a 16 MiB local buffer), mounting ``segment_bytes``: for
    what a benchmark measures or asks below the backend. RuntimeError if its
    setup fails."""
    from mooncake.store import MooncakeDistributedStore

    native = MooncakeDistributedStore()
    master = client_config["master_server_address"]
    rc = native.setup(
        client_config["local_hostname"],
        client_config["metadata_server"],
        segment_bytes,
        16 * MiB,
        "tcp",
        "",
        master,
    )
    if rc != 0:
        raise RuntimeError(f"a bare Mooncake client of {master} did not set up: {rc}")
    return native


class TimedNativeStore(TimedProxy):
    """The one ``MooncakeDistributedStore`` of a topology, handed to every contender.

    Every data and existence call is timed, so "Python time" = wall - native
    time is measured the same way for every contender. With ``shared`` (the
    default) the harness owns the client: ``setup``/``close`` are no-ops and a
    buffer is registered once however many contenders register it. Without,
    the backend that made the client owns it and those calls go through.
    """

    def __init__(self, store: Any, *, shared: bool = True) -> None:
        super().__init__(store, (*_IO_CALLS, "batch_is_exist"), self._count)
        self.counters = NativeCounters()
        self._shared = shared
        self._registered: dict[int, int] = {}

    def _count(
        self, name: str, args: tuple[Any, ...], wall_s: float, seconds: float, error: object
    ) -> None:
        c = self.counters
        if name == "batch_is_exist":
            c.exist_s += seconds
            c.exist_calls += 1
            c.exist_keys += len(args[0])
            return
        c.io_s += seconds
        c.io_calls += 1
        c.io_objects += len(args[0])
        c.io_buffers += _buffer_count(name, args)

    def snapshot(self) -> NativeCounters:
        return NativeCounters(**asdict(self.counters))

    def setup(self, *args: Any, **kwargs: Any) -> int:
        return 0 if self._shared else self._target.setup(*args, **kwargs)

    def close(self) -> int:
        return 0 if self._shared else self._target.close()

    def register_buffer(self, ptr: int, size: int) -> int:
        if not self._shared:
            return self._target.register_buffer(ptr, size)
        if self._registered.get(ptr, -1) >= size:
            return 0
        rc = self._target.register_buffer(ptr, size)
        if rc == 0:
            self._registered[ptr] = size
        return rc

    def unregister_all(self) -> None:
        for ptr in list(self._registered):
            self._target.unregister_buffer(ptr)
        self._registered.clear()


class RecordingNative(TimedNativeStore):
    """A native client that also keeps what the benchmarks counting objects read:
    the keys of every existence call, every object a put stored (with its
    bytes), and every put call, object and answer code.

    The recorded calls are not timed: no benchmark that records reads the
    native seconds."""

    def __init__(self, store: Any, *, shared: bool = True) -> None:
        super().__init__(store, shared=shared)
        self.exist_calls: list[list[str]] = []
        self.stored: dict[str, int] = {}  # object key -> bytes
        self.put_calls = 0
        self.put_objects = 0
        self.put_codes: collections.Counter[int] = collections.Counter()

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.exist_calls.append(list(keys))
        return self._target.batch_is_exist(keys)

    def batch_put_from_multi_buffers(self, keys: list[str], ptrs: Any, sizes: Any, *config: Any):
        codes = self._target.batch_put_from_multi_buffers(keys, ptrs, sizes, *config)
        return self._record(keys, sizes, codes)

    def batch_put_from(self, keys: list[str], ptrs: Any, sizes: Any, *config: Any) -> Any:
        return self._record(keys, sizes, self._target.batch_put_from(keys, ptrs, sizes, *config))

    def _record(self, keys: list[str], sizes: Any, codes: Any) -> Any:
        self.put_calls += 1
        self.put_objects += len(keys)
        if isinstance(codes, list):
            self.put_codes.update(int(c) for c in codes)
            for key, size, code in zip(keys, sizes, codes, strict=False):
                if code == 0:
                    self.stored[key] = size if isinstance(size, int) else sum(size)
        return codes


class Topology:
    """A cluster plus the one native client every contender of a topology shares."""

    def __init__(self, kind: str, config: BenchConfig) -> None:
        self.kind = kind
        self.config = config
        self.cluster: LocalCluster | None = None
        self.native: Any = None
        self.store: TimedNativeStore | None = None
        self.client_config: dict[str, Any] = {}

    def __enter__(self) -> Topology:
        cfg = self.config
        if self.kind == "remote":
            self.client_config = {
                "master_server_address": cfg.master_server_address,
                "metadata_server": cfg.metadata_server,
                "local_hostname": os.environ.get("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
                "global_segment_size": 0,
            }
        else:
            nodes = 0 if self.kind == "same" else 1
            spec = ClusterSpec(storage_nodes=nodes, storage_node_segment_bytes=cfg.segment_bytes)
            self.cluster = LocalCluster(spec).start()
            segment = cfg.segment_bytes if self.kind == "same" else 0
            self.client_config = dict(self.cluster.client_config(segment))
        self.client_config.update(protocol=cfg.protocol, device_name=cfg.device)
        try:
            self._connect()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _connect(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        cfg, c = self.config, self.client_config
        # The same environment a backend-created client would get.
        for name, value in native_env_defaults(SpanOptions()).items():
            os.environ.setdefault(name, value)
        native = MooncakeDistributedStore()
        rc = native.setup(
            c["local_hostname"],
            c["metadata_server"],
            int(c["global_segment_size"]),
            16 * MiB,
            cfg.protocol,
            cfg.device,
            c["master_server_address"],
        )
        if rc != 0:
            raise RuntimeError(f"Mooncake setup failed with {rc} for topology {self.kind}")
        self.native = native
        self.store = TimedNativeStore(native)

    def _disconnect(self) -> None:
        if self.native is not None:
            with contextlib.suppress(Exception):
                self.native.remove_all(True)
            self.native.close()
            self.native = None

    @contextlib.contextmanager
    def own_client(self) -> Iterator[Topology]:
        """A second client on this topology's cluster, without a segment of its own."""
        other = Topology(self.kind, self.config)
        other.client_config = {**self.client_config, "global_segment_size": 0}
        other._connect()
        try:
            yield other
        finally:
            other._disconnect()

    def __exit__(self, *exc: object) -> None:
        self._disconnect()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
