"""What a ``LocalCluster`` starts (``ClusterSpec``), and ``ExternalCluster`` for a running one.

Pure validation, no processes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from mooncake_span.mooncake_settings import validate_master_address, validate_metadata_server
from mooncake_span.store.ssd_tier import CHECK_MODES
from mooncake_span.units import parse_size_bytes

# The master flags ``mooncake-span cluster up`` starts with (ClusterSpec itself keeps
# Mooncake's defaults); why these values: docs/operating.md, "A local cluster".
CLUSTER_UP_LEASE_TTL_MS = 2000
# With an SSD tier; why: docs/operating.md, "What the launcher sets, and why".
SSD_LEASE_TTL_MS = 500
SSD_EVICTION_HIGH_WATERMARK_RATIO = 0.7
SSD_EVICTION_RATIO = 0.2
CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO = 0.9
CLUSTER_UP_EVICTION_RATIO = 0.05


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. All fields are validated on construction.

    Sizes accept ints or strings such as ``"512mb"`` and are stored as ints.
    ``None`` for a master tunable keeps Mooncake's default (lease 10 s,
    client TTL 10 s, eviction high watermark 0.9).
    """

    host: str = "127.0.0.1"
    storage_nodes: int = 0
    storage_node_segment_bytes: int = 256 << 20
    storage_node_local_buffer_bytes: int = 16 << 20
    etcd: bool = False
    standalone_metadata: bool = False
    ha_masters: int = 1
    enable_oplog: bool = False
    lease_ttl_ms: int | None = None
    client_ttl_s: int | None = None
    eviction_high_watermark_ratio: float | None = None
    # Share of objects one eviction pass frees (Mooncake's default 0.05).
    eviction_ratio: float | None = None
    master_extra_args: tuple[str, ...] = ()
    # SSD tier (ssd_size_bytes per node, None: 90% of the disk); the master then runs
    # with --enable_offload and, unless given, the SSD_* lease and eviction values.
    ssd_dir: str | Path | None = None
    ssd_size_bytes: int | None = None
    ssd_read_buffer_bytes: int | None = None
    # Each node's check of its directory at start (store/ssd_scan.py); None:
    # the node's own default (MOONCAKE_SPAN_SSD_CHECK, else size).
    ssd_check: str | None = None
    log_dir: str | Path | None = None
    # Added to the environment of every child and to client_env().
    env_overrides: Mapping[str, str] = field(default_factory=dict, hash=False)
    start_timeout_s: float = 60.0
    # Above the SSD nodes' own bound on a stop (--ssd-stop-wait-s, 20 s): a stop that lets
    # its offloads finish is not cut short into a crash.
    stop_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        try:
            address = ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(
                f"ClusterSpec.host={self.host!r} is not an IP address; use a local IPv4 address "
                f"such as '127.0.0.1'"
            ) from None
        if address.version != 4:
            raise ValueError(f"ClusterSpec.host={self.host!r}: only IPv4 addresses are supported")
        _require_int(self.storage_nodes, "storage_nodes", minimum=0)
        _require_int(self.ha_masters, "ha_masters", minimum=1)
        self._parse_sizes("storage_node_segment_bytes", "storage_node_local_buffer_bytes")
        if self.storage_nodes and self.storage_node_segment_bytes <= 0:
            raise ValueError(
                f"ClusterSpec.storage_node_segment_bytes must be > 0 when storage_nodes="
                f"{self.storage_nodes}; a storage node exists to contribute memory"
            )
        if self.ha_masters > 1 and not self.etcd:
            raise ValueError(
                f"ClusterSpec(ha_masters={self.ha_masters}) needs etcd for leader election; "
                f"set etcd=True (--etcd on the command line) or ha_masters=1"
            )
        if self.enable_oplog and self.ha_masters < 2:
            raise ValueError(
                "ClusterSpec.enable_oplog replicates metadata between HA masters; "
                "set ha_masters >= 2 (and etcd=True), or drop enable_oplog"
            )
        for name in ("lease_ttl_ms", "client_ttl_s"):
            if getattr(self, name) is not None:
                _require_int(getattr(self, name), name, minimum=1)
        self._check_ssd()
        for name in ("eviction_high_watermark_ratio", "eviction_ratio"):
            ratio = getattr(self, name)
            if ratio is not None and (
                isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1
            ):
                raise ValueError(f"ClusterSpec.{name}={ratio!r} must be a number in (0, 1]")
        if isinstance(self.master_extra_args, str) or not all(
            isinstance(arg, str) and arg.startswith("--") for arg in self.master_extra_args
        ):
            raise ValueError(
                f"ClusterSpec.master_extra_args={self.master_extra_args!r} must be a tuple of "
                f"'--flag=value' strings"
            )
        object.__setattr__(self, "master_extra_args", tuple(self.master_extra_args))
        env = dict(self.env_overrides)
        for key, value in env.items():
            if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
                raise ValueError(
                    f"ClusterSpec.env_overrides entry {key!r}={value!r}: names and values "
                    f"must be strings and names must not contain '='"
                )
        object.__setattr__(self, "env_overrides", MappingProxyType(env))
        for name in ("start_timeout_s", "stop_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"ClusterSpec.{name}={value!r} must be a positive number")

    def _check_ssd(self) -> None:
        sizes = ("ssd_size_bytes", "ssd_read_buffer_bytes")
        if self.ssd_check is not None and self.ssd_check not in CHECK_MODES:
            raise ValueError(
                f"ClusterSpec.ssd_check must be one of {CHECK_MODES}, got {self.ssd_check!r}"
            )
        if self.ssd_dir is None:
            given = [name for name in (*sizes, "ssd_check") if getattr(self, name) is not None]
            if given:
                raise ValueError(f"ClusterSpec.{given[0]} needs ssd_dir (--ssd-dir)")
            return
        if not self.storage_nodes:
            raise ValueError(
                "ClusterSpec.ssd_dir gives storage nodes an SSD tier; set storage_nodes >= 1"
            )
        object.__setattr__(self, "ssd_dir", Path(self.ssd_dir))
        self._parse_sizes(*(name for name in sizes if getattr(self, name) is not None))
        if (
            self.ssd_size_bytes is not None
            and self.ssd_size_bytes < self.storage_node_segment_bytes
        ):
            raise ValueError(
                f"ClusterSpec.ssd_size_bytes={self.ssd_size_bytes} is smaller than one object a "
                f"node may hold (up to its {self.storage_node_segment_bytes}-byte segment); give "
                f"--ssd-size at least the segment size (several times it, or the SSD tier holds "
                f"less than DRAM)"
            )

    def _parse_sizes(self, *names: str) -> None:
        for name in names:
            try:
                object.__setattr__(self, name, parse_size_bytes(getattr(self, name)))
            except ValueError as exc:
                raise ValueError(f"ClusterSpec.{name}: {exc}") from None

    @property
    def master_lease_ttl_ms(self) -> int | None:
        return self._ssd_default(self.lease_ttl_ms, SSD_LEASE_TTL_MS)

    @property
    def master_eviction_high_watermark_ratio(self) -> float | None:
        return self._ssd_default(
            self.eviction_high_watermark_ratio, SSD_EVICTION_HIGH_WATERMARK_RATIO
        )

    @property
    def master_eviction_ratio(self) -> float | None:
        return self._ssd_default(self.eviction_ratio, SSD_EVICTION_RATIO)

    def _ssd_default(self, given: float | None, with_ssd: float) -> float | None:
        return with_ssd if given is None and self.ssd_dir is not None else given

    @property
    def ha(self) -> bool:
        return self.ha_masters > 1

    @property
    def metadata_mode(self) -> str:
        """``"standalone"``, ``"etcd"`` (HA masters) or ``"embedded"`` (in the master)."""
        if self.standalone_metadata:
            return "standalone"
        if self.ha:
            return "etcd"
        return "embedded"


def _require_int(value: object, name: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ClusterSpec.{name}={value!r} must be an int >= {minimum}")


@dataclass(frozen=True)
class ExternalCluster:
    """A cluster someone else runs (fixtures pointed at a deployment): the client-facing
    half of LocalCluster's API."""

    master_address: str
    metadata_server: str
    host: str = "127.0.0.1"
    env: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        validate_master_address(self.master_address)
        validate_metadata_server(self.metadata_server)
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    def client_config(self, global_segment_size_bytes: int = 0) -> dict[str, object]:
        return sglang_client_config(
            self.master_address, self.metadata_server, self.host, global_segment_size_bytes
        )

    def client_env(self) -> dict[str, str]:
        return {"MC_TCP_BIND_ADDRESS": self.host, **self.env}


def sglang_client_config(
    master_address: str,
    metadata_server: str,
    host: str,
    global_segment_size_bytes: int,
    admin_url: str | None = None,
) -> dict[str, object]:
    size_bytes = parse_size_bytes(global_segment_size_bytes)
    config: dict[str, object] = {
        "master_server_address": master_address,
        "metadata_server": metadata_server,
        "protocol": "tcp",
        "local_hostname": host,
        "global_segment_size": size_bytes,
    }
    if admin_url is not None:
        # Failure-domain placement lists segments on the master's admin port;
        # local clusters pick that port freely, so the default (9003) is wrong.
        config["span_master_admin_url"] = admin_url
    return config
