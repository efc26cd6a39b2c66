"""``MooncakeSettings``: sglang 0.5.23's ``MooncakeStore`` config, resolved for one rank.

Read as ``MooncakeStore`` reads it (sources, precedence, per-rank split), so a
deployment switches backends without touching its config; every key it reads means
the same here or is refused: docs/operating.md, "sglang's Mooncake keys".
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_span.config import ENV_KEYS, check_host_port, parse_int, parse_sglang_flag
from mooncake_span.errors import ConfigError
from mooncake_span.units import parse_size_bytes

logger = logging.getLogger(__name__)

CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
# sglang's defaults for MOONCAKE_* (sglang/srt/environ.py, 0.5.23).
_DEFAULT_LOCAL_HOSTNAME = "localhost"
_DEFAULT_METADATA_SERVER = "P2PHANDSHAKE"
_DEFAULT_GLOBAL_SEGMENT = "4gb"
_DEFAULT_PROTOCOL = "rdma"
_DEFAULT_LOCAL_BUFFER_BYTES = 16 * 1024 * 1024
DEFAULT_TENANT_ID = "default"

KNOWN_PROTOCOLS = ("tcp", "rdma", "efa", "nvlink", "nvlink_intra", "cxl", "ascend", "hip", "barex")


def validate_master_address(value: str) -> str:
    """``HOST:PORT``, or ``etcd://HOST:PORT[;HOST:PORT...]`` for HA masters."""
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"invalid master address (master_server_address) {value!r}: expected HOST:PORT"
        )
    if value.startswith("etcd://"):
        # Mooncake separates several etcd endpoints with ';' (etcd://h1:p1;h2:p2).
        for endpoint in value[len("etcd://") :].split(";"):
            check_host_port(endpoint, "master address (etcd endpoint)")
        return value
    if "://" in value:
        raise ConfigError(
            f"invalid master address (master_server_address) {value!r}: use HOST:PORT, "
            "or etcd://HOST:PORT for HA masters"
        )
    check_host_port(value, "master address (master_server_address)")
    return value


def validate_metadata_server(value: str) -> str:
    """Refuse, before ``setup``, a metadata URL with an unknown scheme: Mooncake
    would abort the whole process (LOG(FATAL)). Only the back-ends measured with
    this wheel pass: the HTTP metadata server, etcd, P2PHANDSHAKE."""
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"invalid metadata server (metadata_server) {value!r}: expected e.g. http://HOST:PORT/metadata"
        )
    if value == "P2PHANDSHAKE":
        return value
    scheme, sep, rest = value.partition("://")
    if not sep:
        # No scheme means etcd to Mooncake.
        for endpoint in value.split(";"):
            check_host_port(endpoint, "metadata server (bare etcd endpoint)")
        return value
    if scheme in ("http", "https"):
        check_host_port(rest.split("/", 1)[0], "metadata server (metadata_server)")
        return value
    if scheme == "etcd":
        for endpoint in rest.split("/", 1)[0].split(";"):
            check_host_port(endpoint, "metadata server (etcd endpoint)")
        return value
    raise ConfigError(
        f"invalid metadata server (metadata_server) {value!r}: scheme {scheme!r} is not supported; "
        "use 'P2PHANDSHAKE', 'http://HOST:PORT/metadata' or 'etcd://HOST:PORT'"
    )


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """The parts of sglang's ``HiCacheStorageConfig`` that change what reaches ``setup``."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # With dp-attention tp_rank is group-local; dp_rank tells the groups apart.
    dp_rank: int = 0
    attn_cp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(f"pp_rank {self.pp_rank} is outside 0..{self.pp_size - 1}")
        if self.dp_rank < 0 or self.attn_cp_rank < 0:
            raise ConfigError(
                f"dp_rank and attn_cp_rank must be >= 0, got {self.dp_rank}, {self.attn_cp_rank}"
            )

    @classmethod
    def from_storage_config(cls, storage_config: Any) -> RankInfo | None:
        """None without a storage config: then, as upstream, nothing is split or mapped."""
        if storage_config is None:
            return None
        return cls(
            tp_rank=int(storage_config.tp_rank),
            tp_size=int(storage_config.tp_size),
            pp_rank=int(storage_config.pp_rank),
            pp_size=int(storage_config.pp_size),
            dp_rank=int(getattr(storage_config, "dp_rank", 0)),
            attn_cp_rank=int(getattr(storage_config, "attn_cp_rank", 0)),
        )

    @property
    def ranks_per_server(self) -> int:
        """The ranks one sglang server's ``global_segment_size`` is split over."""
        return self.tp_size * self.pp_size

    @property
    def ssd_subdir(self) -> str:
        # Upstream's name: ranks sharing one offload directory truncate each other's buckets.
        return f"rank_{self.dp_rank}_{self.tp_rank}_{self.pp_rank}_{self.attn_cp_rank}"


@dataclass(frozen=True, kw_only=True)
class MooncakeSettings:
    """Arguments of ``MooncakeDistributedStore.setup`` for this rank (per-rank
    values, not the configured ones), plus where they came from."""

    master_server_address: str
    metadata_server: str = _DEFAULT_METADATA_SERVER
    local_hostname: str = _DEFAULT_LOCAL_HOSTNAME
    global_segment_size_bytes: int = parse_size_bytes(_DEFAULT_GLOBAL_SEGMENT)
    local_buffer_size_bytes: int = _DEFAULT_LOCAL_BUFFER_BYTES
    protocol: str = _DEFAULT_PROTOCOL
    device_name: str = ""
    tenant_id: str = DEFAULT_TENANT_ID
    enable_ssd_offload: bool = False
    ssd_offload_path: str | None = None
    # Wait (bounded) before setup until the master lists a segment.
    check_server: bool = False
    # The master's admin HTTP port (its --metrics_port): segment listing. None:
    # not configured (sglang's check_server and the tools then try 9003).
    master_metrics_port: int | None = None
    source: str = "explicit"

    def __post_init__(self) -> None:
        validate_master_address(self.master_server_address)
        validate_metadata_server(self.metadata_server)
        if not self.local_hostname:
            raise ConfigError("local_hostname must not be empty")
        if self.global_segment_size_bytes < 0:
            raise ConfigError(
                f"global_segment_size must be >= 0 bytes, got {self.global_segment_size_bytes}"
            )
        if self.local_buffer_size_bytes <= 0:
            raise ConfigError(
                f"local_buffer_size must be > 0 bytes, got {self.local_buffer_size_bytes}"
            )
        if self.protocol not in KNOWN_PROTOCOLS:
            raise ConfigError(
                f"protocol {self.protocol!r} is not one Mooncake supports; "
                f"choose one of {', '.join(KNOWN_PROTOCOLS)}"
            )
        if not self.tenant_id or self.tenant_id != self.tenant_id.strip():
            raise ConfigError(f"tenant_id must be a non-blank name, got {self.tenant_id!r}")
        if self.ssd_offload_path is not None and not self.ssd_offload_path:
            raise ConfigError("ssd_offload_path must be a directory path, got ''")
        if self.master_metrics_port is not None and not 0 < self.master_metrics_port < 65536:
            raise ConfigError(
                f"master_metrics_port must be in 1..65535, got {self.master_metrics_port}"
            )

    def etcd_endpoints(self) -> list[str]:
        """host:port of every etcd endpoint setup would contact (master and metadata)."""
        endpoints: list[str] = []
        if self.master_server_address.startswith("etcd://"):
            endpoints += self.master_server_address[len("etcd://") :].split(";")
        md = self.metadata_server
        if md.startswith("etcd://"):
            endpoints += md[len("etcd://") :].split("/", 1)[0].split(";")
        elif md != "P2PHANDSHAKE" and "://" not in md:
            endpoints += md.split(";")
        return endpoints

    def admin_url(self) -> str | None:
        """The master's admin server on master_metrics_port, 9003 when none is configured
        (as sglang's check_server looks for it); None for etcd-discovered masters."""
        if self.master_server_address.startswith("etcd://"):
            return None
        host = self.master_server_address.rpartition(":")[0]
        return f"http://{host}:{self.master_metrics_port or 9003}"  # mooncake_master's default

    def configured_admin_url(self) -> str | None:
        """``admin_url`` only when master_metrics_port was configured: never a guess."""
        return None if self.master_metrics_port is None else self.admin_url()


def _size(value: Any, key: str) -> int:
    try:
        return parse_size_bytes(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def _port(value: Any, source: str) -> int | None:
    try:
        return None if value is None else parse_int(value, "master_metrics_port")
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({source})") from exc


def _text(value: Any, key: str, source: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ConfigError(f"{key} ({source}) must be a string, got {value!r}")
    return str(value)


def resolve_device(device_name: str, ranks: RankInfo | None, source: str) -> str:
    """This rank's NIC: a JSON ``{"<tp_rank>": "mlx5_N", ...}`` map is looked up by tp_rank.

    A rank the map leaves out gets "" (Mooncake then picks a NIC itself), as upstream.
    """
    if not device_name.strip().startswith("{"):
        return device_name
    try:
        device_map = json.loads(device_name)
    except ValueError as exc:
        raise ConfigError(
            f"device_name ({source}) starts with '{{' but is not a JSON rank -> NIC map: {exc}"
        ) from exc
    if not isinstance(device_map, dict):
        raise ConfigError(f"device_name ({source}) must be a JSON object, got {device_name!r}")
    bad = {k: v for k, v in device_map.items() if not isinstance(v, str)}
    if bad:
        raise ConfigError(f"device_name ({source}) maps ranks to non-strings: {bad}")
    if ranks is None:
        return ""
    # JSON object keys are always strings; 0 and "0" name the same rank.
    device = device_map.get(str(ranks.tp_rank), "")
    if not device:
        logger.warning(
            "mooncake-span: device_name map (%s) names no NIC for tp_rank %d; "
            "Mooncake picks one itself",
            source,
            ranks.tp_rank,
        )
    return device


def _ssd_path(value: Any, ranks: RankInfo | None, source: str) -> str | None:
    if value is None:
        return None
    path = _text(value, "ssd_offload_path", source)
    if not path:
        raise ConfigError(f"ssd_offload_path ({source}) must be a directory path, got ''")
    return path if ranks is None else os.path.join(path, ranks.ssd_subdir)


def _settings_from_mapping(
    values: Mapping[str, Any], environ: Mapping[str, str], source: str, ranks: RankInfo | None
) -> MooncakeSettings:
    # A null value means "not set" for every key.
    values = {k: v for k, v in values.items() if v is not None}

    def text(key: str, default: Any = "") -> str:
        return _text(values.get(key, default), key, source)

    def flag(key: str) -> bool:
        return parse_sglang_flag(values.get(key, False), key, source)

    if flag("standalone_storage"):
        raise ConfigError(
            "standalone_storage=True (a separate mooncake_client owning the segment) is not "
            "supported by mooncake-span; run the store client in-process "
            "(global_segment_size=0 for a pure client) and dedicated storage nodes instead"
        )
    if "client_server_address" in values:
        raise ConfigError(
            f"client_server_address ({source}) only serves standalone_storage, which "
            "mooncake-span does not support; remove it and set master_server_address"
        )
    if not values.get("master_server_address"):
        raise ConfigError(f"master_server_address is required ({source})")
    segment_bytes = _size(
        values.get("global_segment_size", _DEFAULT_GLOBAL_SEGMENT), "global_segment_size"
    )
    ssd = flag("enable_ssd_offload")
    ssd_path = _ssd_path(values.get("ssd_offload_path"), ranks, source)
    if ssd_path is not None and not ssd:
        logger.warning(
            "mooncake-span: ssd_offload_path is set but enable_ssd_offload is not (%s): the path "
            "reaches Mooncake as with sglang's MooncakeStore, and nothing is offloaded",
            source,
        )
    # Process environment first: a shared extra-config must not pin every host
    # to the same name (same rule as upstream MooncakeStore).
    hostname = environ.get("MOONCAKE_LOCAL_HOSTNAME") or environ.get("LOCAL_HOSTNAME")
    return MooncakeSettings(
        master_server_address=text("master_server_address"),
        metadata_server=text("metadata_server", _DEFAULT_METADATA_SERVER),
        local_hostname=hostname or str(values.get("local_hostname") or _DEFAULT_LOCAL_HOSTNAME),
        # Per server: every rank of a tp x pp server contributes its share.
        global_segment_size_bytes=segment_bytes // (ranks.ranks_per_server if ranks else 1),
        local_buffer_size_bytes=_size(
            values.get("local_buffer_size", _DEFAULT_LOCAL_BUFFER_BYTES), "local_buffer_size"
        ),
        protocol=text("protocol", environ.get("MOONCAKE_PROTOCOL", _DEFAULT_PROTOCOL)),
        device_name=resolve_device(text("device_name"), ranks, source),
        # Upstream: missing, null or blank means the default tenant.
        tenant_id=text("tenant_id").strip() or DEFAULT_TENANT_ID,
        enable_ssd_offload=ssd,
        ssd_offload_path=ssd_path,
        check_server=flag("check_server"),
        master_metrics_port=_port(values.get("master_metrics_port"), source),
        source=source,
    )


def load_mooncake_settings(
    extra_config: Mapping[str, Any] | None,
    environ: Mapping[str, str] | None = None,
    ranks: RankInfo | None = None,
) -> MooncakeSettings:
    """Resolve this rank's Mooncake connection with upstream MooncakeStore's precedence.

    ``ranks`` is the rank sglang gave the backend (None: no storage config, as
    upstream: the segment is not split and a device map resolves to "").
    """
    environ = os.environ if environ is None else environ
    extra = extra_config or {}
    if (
        extra.get("master_server_address") is not None
        or extra.get("client_server_address") is not None
    ):
        return _settings_from_mapping(extra, environ, "extra_config", ranks)
    if CONFIG_PATH_ENV in environ:
        path = environ[CONFIG_PATH_ENV]
        try:
            with open(path, encoding="utf-8") as fh:
                values = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {CONFIG_PATH_ENV}={path!r}: {exc}") from exc
        if not isinstance(values, dict):
            raise ConfigError(f"{CONFIG_PATH_ENV}={path!r} must hold a JSON object")
        return _settings_from_mapping(values, environ, f"file {path}", ranks)
    if not environ.get("MOONCAKE_MASTER") and not environ.get("MOONCAKE_CLIENT"):
        raise ConfigError(
            "no Mooncake master configured: set master_server_address in "
            f"--hicache-storage-backend-extra-config, or {CONFIG_PATH_ENV}, or MOONCAKE_MASTER"
        )
    values = {key: environ[name] for name, key in ENV_KEYS.items() if name in environ}
    return _settings_from_mapping(values, environ, "environment", ranks)
