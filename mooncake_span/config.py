"""Configuration: mooncake-span's own options and the parsers every config source shares.

``SpanOptions``: extra-config keys, then ``MOONCAKE_SPAN_<NAME>`` variables, then
defaults; an unknown ``span_*`` key is an error (a typo must not fall back to a
default). sglang's ``MooncakeStore`` keys: :mod:`mooncake_span.mooncake_settings`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mooncake_span.errors import ConfigError
from mooncake_span.units import parse_size_bytes

logger = logging.getLogger(__name__)

# MOONCAKE_* variable -> key, as sglang 0.5.23's MooncakeStore reads them (load_from_env).
ENV_KEYS = {
    "MOONCAKE_MASTER": "master_server_address",
    "MOONCAKE_CLIENT": "client_server_address",
    "MOONCAKE_TE_META_DATA_SERVER": "metadata_server",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_PROTOCOL": "protocol",
    "MOONCAKE_DEVICE": "device_name",
    "MOONCAKE_MASTER_METRICS_PORT": "master_metrics_port",
    "MOONCAKE_CHECK_SERVER": "check_server",
    "MOONCAKE_STANDALONE_STORAGE": "standalone_storage",
    "MOONCAKE_ENABLE_SSD_OFFLOAD": "enable_ssd_offload",
    "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "ssd_offload_path",
    "MOONCAKE_TENANT_ID": "tenant_id",
}
# Every key MooncakeStore reads; load_mooncake_settings gives each its upstream
# meaning or refuses it. (local_buffer_size is ours: upstream always passes 16 MiB.)
MOONCAKE_KEYS = frozenset(ENV_KEYS.values()) | {"local_hostname", "local_buffer_size"}

# Keys other components read from the same extra-config dict (sglang's
# factory and controller; extra_backend_tag and enable_group_semantics are
# read by the backend). They are not ours to reject.
FOREIGN_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "allocator",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "extra_backend_tag",
        "enable_group_semantics",
    }
)

_HOST = re.compile(r"^(?:[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\])$")


def check_host_port(text: str, what: str) -> None:
    """``text`` must be ``host:port`` (a name, an IPv4 address or a bracketed IPv6 one)."""
    host, sep, port = text.rpartition(":")
    if not sep or not _HOST.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"invalid {what} {text!r}: must look like host:port with a port in 1..65535"
        )


def parse_int(value: Any, key: str) -> int:
    """Whole numbers only: 2.7 or True is a mistake, not 2 or 1."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    raise ConfigError(f"{key} must be an integer, got {value!r}")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(value: Any, key: str) -> bool:
    """Strict boolean: an unrecognised string is an error, never truthy."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{key} must be a boolean (true/false/1/0), got {value!r}")


# sglang's EnvBool words; a config file or extra-config must hold JSON booleans,
# since upstream takes any non-empty string there ("false" included) as true.
_ENV_TRUE = {"true", "1", "yes", "y"}
_ENV_FALSE = {"false", "0", "no", "n"}


def parse_sglang_flag(value: Any, key: str, source: str) -> bool:
    """A boolean as sglang reads it from `source` (stricter: what it would misread is refused)."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if source == "environment" and isinstance(value, str):
        if value.lower() in _ENV_TRUE | _ENV_FALSE:
            return value.lower() in _ENV_TRUE
    raise ConfigError(
        f"{key} ({source}) must be a boolean (JSON true/false; in the environment "
        f"true/false/1/0/yes/no), got {value!r}"
    )


LAYOUT_GUARD_MODES = ("off", "store", "etcd")


@dataclass(frozen=True, kw_only=True)
class SpanOptions:
    """mooncake-span's own options. What each means, its variable and its default:
    docs/operating.md, "mooncake-span's own options"."""

    # None: the host page (K=1), unless sglang's storage_config carries storage_page_size.
    storage_page_size: int | None = None
    # Over TCP a call carrying more than 2048 buffers to one peer fails partly
    # (-800, "TCP lane queue-full"): calls are split below this budget.
    max_buffers_per_call: int = 2048
    breaker_failures: int = 3
    breaker_probe_interval_s: float = 2.0
    # Bound for one stalled transfer (MC_TCP_STATUS_TIMEOUT_SEC, default 30 s).
    transfer_timeout_s: int = 5
    replica_num: int = 1
    group_ids: bool = True
    layout_guard: str = "store"
    layout_guard_etcd: str | None = None
    placement: bool = True
    # Why 32k, and why the stripe is opt-in: docs/reliability.md, "The window"
    # and "Past the window".
    chain_window_tokens: int = 32768
    chain_stripe_tokens: int = 0
    master_admin_url: str | None = None
    segment_refresh_s: float = 5.0
    # >= the master's client_ttl (10 s by default), after which it drops a dead segment.
    domain_bad_ttl_s: float = 15.0
    lost_key_ttl_s: float = 30.0
    lost_keys_max: int = 100_000
    staging_buffer_size_bytes: int = 64 << 20
    full_cooldown_s: float = 1.0
    refresh_prefix: bool = True
    skip_unreachable: bool = True
    chain_sample_every: int = 64
    verify_checksums: bool = False
    # None (not given): on where the cluster has an SSD tier, decided when the
    # client connects (store/ssd_marker.py); False there is refused.
    object_checksums: bool | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for key, (ok, bounds) in _LIMITS.items():
            value = getattr(self, _SPAN_KEYS[key][0])
            if value is not None and not ok(value):
                raise ConfigError(f"{key} must be {bounds}, got {value}")
        if not 1 << 12 <= self.staging_buffer_size_bytes <= 1 << 40:
            raise ConfigError(
                "span_staging_buffer_size must be in 4kb..1tb, got "
                f"{self.staging_buffer_size_bytes} bytes"
            )
        if self.layout_guard not in LAYOUT_GUARD_MODES:
            raise ConfigError(
                f"span_layout_guard must be one of {LAYOUT_GUARD_MODES}, got {self.layout_guard!r}"
            )
        if self.layout_guard == "etcd" and not self.layout_guard_etcd:
            raise ConfigError("span_layout_guard='etcd' needs span_layout_guard_etcd=host:port")
        if self.layout_guard_etcd:
            check_host_port(self.layout_guard_etcd, "etcd endpoint (span_layout_guard_etcd)")
        url = self.master_admin_url
        if url is not None and not re.fullmatch(r"https?://[^/\s]+", url.rstrip("/")):
            raise ConfigError(
                "span_master_admin_url must be http://HOST:PORT (the master's --metrics_port), "
                f"got {url!r}"
            )


def _within(low: float, high: float = float("inf")) -> Any:
    return lambda value: low <= value <= high


_TTL = (lambda value: 0 < value <= 86_400, "in (0, 86400] seconds")
# extra-config key -> (check of its value, the range as its error states it)
_LIMITS: dict[str, tuple[Any, str]] = {
    "storage_page_size": (_within(0), ">= 0 tokens (0 = host page size)"),
    "span_max_buffers_per_call": (_within(1, 1 << 20), "in 1..1048576"),
    "span_breaker_failures": (_within(1), ">= 1"),
    "span_breaker_probe_interval_s": (lambda value: value > 0, "> 0"),
    "span_transfer_timeout_s": (_within(1, 3600), "in 1..3600 seconds"),
    "span_replica_num": (_within(1), ">= 1"),
    "span_segment_refresh_s": _TTL,
    "span_domain_bad_ttl_s": _TTL,
    "span_lost_key_ttl_s": _TTL,
    "span_full_cooldown_s": (_within(0, 3600), "in [0, 3600] seconds (0 disables)"),
    "span_chain_window_tokens": (_within(1, 1 << 30), f"in 1..{1 << 30} tokens"),
    "span_chain_stripe_tokens": (
        _within(0, 1 << 30),
        f"in 0..{1 << 30} tokens (0: one node per window)",
    ),
    "span_chain_sample_every": (_within(0, 1_000_000), "in 0..1000000 (0: no chain records)"),
    "span_lost_keys_max": (_within(1, 10_000_000), "in 1..10000000"),
}


# extra-config key -> (dataclass field, parser)
_SPAN_KEYS: dict[str, tuple[str, Any]] = {
    "storage_page_size": ("storage_page_size", parse_int),
    "span_max_buffers_per_call": ("max_buffers_per_call", parse_int),
    "span_breaker_failures": ("breaker_failures", parse_int),
    "span_breaker_probe_interval_s": ("breaker_probe_interval_s", float),
    "span_transfer_timeout_s": ("transfer_timeout_s", parse_int),
    "span_replica_num": ("replica_num", parse_int),
    "span_group_ids": ("group_ids", parse_bool),
    "span_layout_guard": ("layout_guard", str),
    "span_layout_guard_etcd": ("layout_guard_etcd", str),
    "span_placement": ("placement", parse_bool),
    "span_chain_window_tokens": ("chain_window_tokens", parse_int),
    "span_chain_stripe_tokens": ("chain_stripe_tokens", parse_int),
    "span_master_admin_url": ("master_admin_url", str),
    "span_segment_refresh_s": ("segment_refresh_s", float),
    "span_domain_bad_ttl_s": ("domain_bad_ttl_s", float),
    "span_lost_key_ttl_s": ("lost_key_ttl_s", float),
    "span_lost_keys_max": ("lost_keys_max", parse_int),
    "span_staging_buffer_size": ("staging_buffer_size_bytes", parse_size_bytes),
    "span_full_cooldown_s": ("full_cooldown_s", float),
    "span_refresh_prefix": ("refresh_prefix", parse_bool),
    "span_skip_unreachable": ("skip_unreachable", parse_bool),
    "span_chain_sample_every": ("chain_sample_every", parse_int),
    "span_verify_checksums": ("verify_checksums", parse_bool),
    "span_object_checksums": ("object_checksums", parse_bool),
}
assert {f for f, _ in _SPAN_KEYS.values()} <= {f.name for f in fields(SpanOptions)}


def _is_our_key(key: str) -> bool:
    return key == "storage_page_size" or key.startswith("span_")


def load_span_options(
    extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> SpanOptions:
    """extra-config > MOONCAKE_SPAN_* env > defaults; unknown ``span_*`` keys are errors."""
    environ = os.environ if environ is None else environ
    extra = dict(extra_config or {})
    unknown = sorted(k for k in extra if _is_our_key(k) and k not in _SPAN_KEYS)
    if unknown:
        raise ConfigError(f"unknown mooncake-span option(s) {unknown}; known: {sorted(_SPAN_KEYS)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, (field_name, parse) in _SPAN_KEYS.items():
        env_name = "MOONCAKE_SPAN_" + key.removeprefix("span_").upper()
        if key in extra and extra[key] is not None:
            raw, origin = extra[key], "extra_config"
        elif environ.get(env_name):
            raw, origin = environ[env_name], env_name
        else:
            continue
        try:
            values[field_name] = parse(raw, key) if parse in (parse_bool, parse_int) else parse(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key} ({origin}) is invalid: {raw!r} ({exc})") from exc
        sources[field_name] = origin
    # sglang's enable_group_semantics (eviction group ids), when set, sets
    # span_group_ids; contradicting it is refused.
    if extra.get("enable_group_semantics") is not None:
        wanted = parse_sglang_flag(
            extra["enable_group_semantics"], "enable_group_semantics", "extra_config"
        )
        if "group_ids" in values and values["group_ids"] != wanted:
            raise ConfigError(
                f"enable_group_semantics={wanted} contradicts span_group_ids={values['group_ids']} "
                f"({sources['group_ids']}); set only one of them"
            )
        values["group_ids"] = wanted
        sources["group_ids"] = "extra_config (enable_group_semantics)"
    strays = sorted(
        k for k in extra if not _is_our_key(k) and k not in FOREIGN_KEYS | MOONCAKE_KEYS
    )
    if strays:
        logger.warning("ignoring extra-config keys no component reads: %s", strays)
    return SpanOptions(**values, sources=sources)
