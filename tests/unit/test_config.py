"""Configuration loading (mooncake_span.config).

Every test passes its own ``environ`` dict: the loaders must never need (or
touch) the real process environment to be tested.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_span.config import SpanOptions, load_span_options, parse_bool
from mooncake_span.errors import ConfigError
from mooncake_span.mooncake_settings import (
    CONFIG_PATH_ENV,
    MooncakeSettings,
    RankInfo,
    load_mooncake_settings,
    validate_metadata_server,
)

EXTRA_MASTER = "10.0.0.1:50051"
FILE_MASTER = "10.0.0.2:50051"
ENV_MASTER = "10.0.0.3:50051"


@pytest.fixture
def config_file(tmp_path: Path):
    def write(values: object) -> str:
        path = tmp_path / "mooncake.json"
        path.write_text(json.dumps(values), encoding="utf-8")
        return str(path)

    return write


@pytest.fixture(autouse=True)
def _os_environ_untouched():
    # The loaders get environ= dicts; the real environment must stay as it was.
    def snapshot() -> dict[str, str]:
        # pytest rewrites PYTEST_CURRENT_TEST on every phase; that one is not ours.
        return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}

    before = snapshot()
    yield
    assert snapshot() == before


# ---------------------------------------------------------------------------
# load_mooncake_settings: which source wins


@pytest.mark.parametrize("use_extra", [True, False])
@pytest.mark.parametrize("use_file", [True, False])
@pytest.mark.parametrize("use_env", [True, False])
def test_source_precedence_matrix(config_file, use_extra, use_file, use_env):
    extra = {"master_server_address": EXTRA_MASTER, "protocol": "tcp"} if use_extra else {}
    environ: dict[str, str] = {}
    if use_file:
        environ[CONFIG_PATH_ENV] = config_file(
            {"master_server_address": FILE_MASTER, "protocol": "tcp"}
        )
    if use_env:
        environ["MOONCAKE_MASTER"] = ENV_MASTER
        environ["MOONCAKE_PROTOCOL"] = "tcp"
    if not (use_extra or use_file or use_env):
        with pytest.raises(ConfigError, match="MOONCAKE_MASTER"):
            load_mooncake_settings(extra, environ=environ)
        return
    settings_ = load_mooncake_settings(extra, environ=environ)
    if use_extra:
        assert (settings_.master_server_address, settings_.source) == (EXTRA_MASTER, "extra_config")
    elif use_file:
        assert settings_.master_server_address == FILE_MASTER
        assert settings_.source == f"file {environ[CONFIG_PATH_ENV]}"
    else:
        assert (settings_.master_server_address, settings_.source) == (ENV_MASTER, "environment")


def test_extra_config_without_master_falls_through_to_the_file(config_file):
    # Our own span_* keys alone do not make extra-config a Mooncake source.
    environ = {CONFIG_PATH_ENV: config_file({"master_server_address": FILE_MASTER})}
    got = load_mooncake_settings({"span_replica_num": 2, "protocol": "tcp"}, environ=environ)
    assert got.master_server_address == FILE_MASTER
    # ... and the file source does not pick up extra-config's protocol.
    assert got.protocol == "rdma"


def test_none_extra_config_is_no_extra_config():
    got = load_mooncake_settings(None, environ={"MOONCAKE_MASTER": ENV_MASTER})
    assert got.source == "environment"


def test_extra_config_values_and_defaults():
    got = load_mooncake_settings(
        {
            "master_server_address": EXTRA_MASTER,
            "metadata_server": "http://10.0.0.1:8080/metadata",
            "global_segment_size": "4gb",
            "local_buffer_size": "64mb",
            "protocol": "tcp",
            "device_name": "mlx5_0",
            "local_hostname": "node-7",
        },
        environ={},
    )
    assert got == MooncakeSettings(
        master_server_address=EXTRA_MASTER,
        metadata_server="http://10.0.0.1:8080/metadata",
        local_hostname="node-7",
        global_segment_size_bytes=4 << 30,
        local_buffer_size_bytes=64 << 20,
        protocol="tcp",
        device_name="mlx5_0",
        source="extra_config",
    )


def test_missing_keys_take_sglang_defaults():
    got = load_mooncake_settings({"master_server_address": EXTRA_MASTER}, environ={})
    assert got.metadata_server == "P2PHANDSHAKE"
    assert got.local_hostname == "localhost"
    assert got.global_segment_size_bytes == 4 << 30
    assert got.local_buffer_size_bytes == 16 << 20
    assert got.protocol == "rdma"
    assert got.device_name == ""


def test_environment_source_reads_every_mooncake_variable():
    got = load_mooncake_settings(
        {},
        environ={
            "MOONCAKE_MASTER": ENV_MASTER,
            "MOONCAKE_TE_META_DATA_SERVER": "etcd://10.0.0.9:2379",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "512mb",
            "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_DEVICE": "erdma_0",
        },
    )
    assert (got.metadata_server, got.global_segment_size_bytes, got.protocol, got.device_name) == (
        "etcd://10.0.0.9:2379",
        512 << 20,
        "tcp",
        "erdma_0",
    )


def test_file_source_parses_sizes_and_types(config_file):
    path = config_file(
        {
            "master_server_address": FILE_MASTER,
            "global_segment_size": "1.5gb",
            "local_buffer_size": 1 << 20,
            "protocol": "tcp",
        }
    )
    got = load_mooncake_settings({}, environ={CONFIG_PATH_ENV: path})
    assert got.global_segment_size_bytes == 3 << 29
    assert got.local_buffer_size_bytes == 1 << 20


@pytest.mark.parametrize("source", ["extra", "file"])
def test_missing_protocol_falls_back_to_mooncake_protocol_env(config_file, source):
    # Upstream MooncakeStore reads protocol=config.get("protocol", MOONCAKE_PROTOCOL)
    # for its file and extra-config sources alike; a drop-in backend must too.
    values = {"master_server_address": EXTRA_MASTER}
    environ = {"MOONCAKE_PROTOCOL": "tcp"}
    extra = values if source == "extra" else {}
    if source == "file":
        environ[CONFIG_PATH_ENV] = config_file(values)
    assert load_mooncake_settings(extra, environ=environ).protocol == "tcp"
    # An explicit value in the source still wins over the variable.
    values["protocol"] = "efa"
    if source == "file":
        environ[CONFIG_PATH_ENV] = config_file(values)
    assert load_mooncake_settings(extra, environ=environ).protocol == "efa"


@pytest.mark.parametrize("source", ["extra", "file", "env"])
@pytest.mark.parametrize(
    ("host_env", "expected"),
    [
        ({}, "from-source"),
        ({"LOCAL_HOSTNAME": "by-local"}, "by-local"),
        ({"MOONCAKE_LOCAL_HOSTNAME": "by-mooncake"}, "by-mooncake"),
        ({"MOONCAKE_LOCAL_HOSTNAME": "by-mooncake", "LOCAL_HOSTNAME": "by-local"}, "by-mooncake"),
        # Empty variables do not count as set.
        ({"MOONCAKE_LOCAL_HOSTNAME": "", "LOCAL_HOSTNAME": "by-local"}, "by-local"),
    ],
)
def test_local_hostname_environment_wins_over_every_source(config_file, source, host_env, expected):
    values = {"master_server_address": EXTRA_MASTER, "local_hostname": "from-source"}
    environ = dict(host_env)
    extra: dict = {}
    if source == "extra":
        extra = values
    elif source == "file":
        environ[CONFIG_PATH_ENV] = config_file(values)
    else:
        environ["MOONCAKE_MASTER"] = EXTRA_MASTER
        # The env source has no local_hostname of its own: the default stands in.
        expected = "localhost" if expected == "from-source" else expected
    assert load_mooncake_settings(extra, environ=environ).local_hostname == expected


# ---------------------------------------------------------------------------
# load_mooncake_settings: rejections


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ({"protocol": "carrier-pigeon"}, ["'carrier-pigeon'", "tcp", "rdma"]),
        ({"metadata_server": "foo://x"}, ["'foo'", "foo://x"]),
        ({"metadata_server": "http://no-port/metadata"}, ["host:port", "no-port"]),
        ({"metadata_server": "etcd://a:2379;b"}, ["host:port", "'b'"]),
        ({"master_server_address": "localhost"}, ["master_server_address", "'localhost'"]),
        ({"master_server_address": "host:99999"}, ["master_server_address", "'host:99999'"]),
        ({"master_server_address": "host:0"}, ["master_server_address", "'host:0'"]),
        ({"master_server_address": "etcd://e1:2379;bad"}, ["etcd endpoint", "'bad'"]),
        ({"global_segment_size": -1}, ["global_segment_size", "-1"]),
        ({"global_segment_size": "-4gb"}, ["global_segment_size", "'-4gb'"]),
        ({"global_segment_size": "4 bananas"}, ["global_segment_size", "'4 bananas'"]),
        ({"local_buffer_size": 0}, ["local_buffer_size", "0"]),
        ({"local_buffer_size": "-1mb"}, ["local_buffer_size", "'-1mb'"]),
        ({"standalone_storage": True}, ["standalone_storage"]),
        ({"master_server_address": ""}, ["master_server_address is required"]),
    ],
)
def test_bad_extra_config_raises_config_error(override, fragments):
    extra = {"master_server_address": EXTRA_MASTER, "protocol": "tcp", **override}
    with pytest.raises(ConfigError) as excinfo:
        load_mooncake_settings(extra, environ={})
    for fragment in fragments:
        assert fragment in str(excinfo.value)


def test_client_server_address_selects_extra_config_and_is_refused():
    # Upstream it only serves standalone_storage (refused here); it still picks
    # the extra-config source, so the environment's master is not used instead.
    with pytest.raises(ConfigError, match=r"client_server_address \(extra_config\)"):
        load_mooncake_settings(
            {"client_server_address": "10.0.0.1:50052"}, environ={"MOONCAKE_MASTER": ENV_MASTER}
        )


def test_unreadable_file(tmp_path):
    path = str(tmp_path / "does-not-exist.json")
    with pytest.raises(ConfigError) as excinfo:
        load_mooncake_settings({}, environ={CONFIG_PATH_ENV: path, "MOONCAKE_MASTER": ENV_MASTER})
    assert CONFIG_PATH_ENV in str(excinfo.value) and path in str(excinfo.value)


def test_file_with_bad_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError, match="cannot read"):
        load_mooncake_settings({}, environ={CONFIG_PATH_ENV: str(path)})


def test_file_holding_a_list(config_file):
    path = config_file([1, 2])
    with pytest.raises(ConfigError, match="JSON object"):
        load_mooncake_settings({}, environ={CONFIG_PATH_ENV: path})


def test_file_without_master(config_file):
    path = config_file({"protocol": "tcp"})
    with pytest.raises(ConfigError, match="master_server_address is required") as excinfo:
        load_mooncake_settings({}, environ={CONFIG_PATH_ENV: path})
    assert path in str(excinfo.value)


def test_env_standalone_storage_is_rejected():
    with pytest.raises(ConfigError, match="standalone_storage"):
        load_mooncake_settings(
            {}, environ={"MOONCAKE_MASTER": ENV_MASTER, "MOONCAKE_STANDALONE_STORAGE": "true"}
        )


@pytest.mark.parametrize(
    "value",
    [
        "P2PHANDSHAKE",
        "http://m:8080/metadata",
        "https://m:443/x",
        "etcd://a:2379;b:2379",
        "a:2379;b:2379",
    ],
)
def test_valid_metadata_servers(value):
    assert validate_metadata_server(value) == value


@pytest.mark.parametrize(
    "value",
    [
        "foo://x",
        "p2phandshake",
        "",
        "http://",
        "file:///tmp/x",
        "redis://r:6379",
        "etcd://a:2379,b:2379",
    ],
)
def test_invalid_metadata_servers(value):
    with pytest.raises(ConfigError):
        validate_metadata_server(value)


def test_mooncake_settings_is_frozen():
    got = MooncakeSettings(master_server_address=EXTRA_MASTER)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.protocol = "tcp"  # type: ignore[misc]


def test_mooncake_settings_validates_when_built_directly():
    with pytest.raises(ConfigError, match="-5"):
        MooncakeSettings(master_server_address=EXTRA_MASTER, global_segment_size_bytes=-5)
    with pytest.raises(ConfigError, match="local_hostname"):
        MooncakeSettings(master_server_address=EXTRA_MASTER, local_hostname="")


def test_etcd_endpoints():
    got = MooncakeSettings(
        master_server_address="etcd://e1:2379;e2:2379",
        metadata_server="etcd://e3:2379",
        protocol="tcp",
    )
    assert got.etcd_endpoints() == ["e1:2379", "e2:2379", "e3:2379"]
    bare = MooncakeSettings(master_server_address=EXTRA_MASTER, metadata_server="e4:2379;e5:2379")
    assert bare.etcd_endpoints() == ["e4:2379", "e5:2379"]
    assert MooncakeSettings(master_server_address=EXTRA_MASTER).etcd_endpoints() == []
    http = MooncakeSettings(
        master_server_address=EXTRA_MASTER, metadata_server="http://m:8080/metadata"
    )
    assert http.etcd_endpoints() == []


# ---------------------------------------------------------------------------
# load_span_options


def test_span_defaults():
    options = load_span_options({}, environ={})
    assert options == SpanOptions()
    assert options.sources == {}
    assert (
        options.storage_page_size,
        options.max_buffers_per_call,
        options.group_ids,
        options.layout_guard,
    ) == (
        None,
        2048,
        True,
        "store",
    )


# (extra-config key, env variable, extra value, env value, field, parsed extra, parsed env)
SPAN_CASES = [
    (
        "storage_page_size",
        "MOONCAKE_SPAN_STORAGE_PAGE_SIZE",
        256,
        "512",
        "storage_page_size",
        256,
        512,
    ),
    (
        "span_max_buffers_per_call",
        "MOONCAKE_SPAN_MAX_BUFFERS_PER_CALL",
        "64",
        "128",
        "max_buffers_per_call",
        64,
        128,
    ),
    ("span_breaker_failures", "MOONCAKE_SPAN_BREAKER_FAILURES", 5, "7", "breaker_failures", 5, 7),
    (
        "span_breaker_probe_interval_s",
        "MOONCAKE_SPAN_BREAKER_PROBE_INTERVAL_S",
        "0.5",
        "3",
        "breaker_probe_interval_s",
        0.5,
        3.0,
    ),
    (
        "span_transfer_timeout_s",
        "MOONCAKE_SPAN_TRANSFER_TIMEOUT_S",
        9,
        "11",
        "transfer_timeout_s",
        9,
        11,
    ),
    ("span_replica_num", "MOONCAKE_SPAN_REPLICA_NUM", 2, "3", "replica_num", 2, 3),
    ("span_group_ids", "MOONCAKE_SPAN_GROUP_IDS", False, "no", "group_ids", False, False),
    (
        "span_layout_guard",
        "MOONCAKE_SPAN_LAYOUT_GUARD",
        "off",
        "store",
        "layout_guard",
        "off",
        "store",
    ),
]


@pytest.mark.parametrize("case", SPAN_CASES, ids=[c[0] for c in SPAN_CASES])
@pytest.mark.parametrize("where", ["extra", "env", "both", "neither"])
def test_span_option_precedence(case, where):
    key, env_name, extra_value, env_value, field, parsed_extra, parsed_env = case
    extra = {key: extra_value} if where in ("extra", "both") else {}
    environ = {env_name: env_value} if where in ("env", "both") else {}
    options = load_span_options(extra, environ=environ)
    default = getattr(SpanOptions(), field)
    expected, origin = {
        "extra": (parsed_extra, "extra_config"),
        "both": (parsed_extra, "extra_config"),
        "env": (parsed_env, env_name),
        "neither": (default, None),
    }[where]
    assert getattr(options, field) == expected
    assert type(getattr(options, field)) is type(expected)
    assert options.sources.get(field) == origin


def test_sources_record_every_origin():
    options = load_span_options(
        {"span_replica_num": 2, "span_layout_guard": "etcd", "span_layout_guard_etcd": "e1:2379"},
        environ={"MOONCAKE_SPAN_BREAKER_FAILURES": "4", "MOONCAKE_SPAN_REPLICA_NUM": "9"},
    )
    assert options.sources == {
        "replica_num": "extra_config",
        "layout_guard": "extra_config",
        "layout_guard_etcd": "extra_config",
        "breaker_failures": "MOONCAKE_SPAN_BREAKER_FAILURES",
    }
    assert (options.replica_num, options.breaker_failures) == (2, 4)


def test_none_in_extra_falls_back_to_env():
    options = load_span_options(
        {"span_replica_num": None}, environ={"MOONCAKE_SPAN_REPLICA_NUM": "3"}
    )
    assert (options.replica_num, options.sources["replica_num"]) == (3, "MOONCAKE_SPAN_REPLICA_NUM")


def test_empty_env_value_is_unset():
    options = load_span_options({}, environ={"MOONCAKE_SPAN_REPLICA_NUM": ""})
    assert options.replica_num == 1 and "replica_num" not in options.sources


@pytest.mark.parametrize("key", ["span_max_buffer_per_call", "span_", "span_groupids"])
def test_unknown_span_key_is_an_error_naming_it(key):
    with pytest.raises(ConfigError) as excinfo:
        load_span_options({key: 1}, environ={})
    message = str(excinfo.value)
    assert repr(key) in message
    # The message lists the valid keys so the typo is easy to fix.
    assert "span_max_buffers_per_call" in message


def test_foreign_keys_are_ignored_and_strays_only_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="mooncake_span.config"):
        options = load_span_options(
            {
                "master_server_address": EXTRA_MASTER,
                "prefetch_threshold": 256,
                "totally_unknown": 1,
            },
            environ={},
        )
    assert options == SpanOptions()
    warnings = [r.getMessage() for r in caplog.records]
    assert any("totally_unknown" in w for w in warnings)
    assert not any("prefetch_threshold" in w or "master_server_address" in w for w in warnings)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        ("1", True),
        ("0", False),
        ("true", True),
        ("FALSE", False),
        (" Yes ", True),
        ("no", False),
        ("on", True),
        ("off", False),
    ],
)
def test_parse_bool_accepts(raw, expected):
    assert parse_bool(raw, "k") is expected


@pytest.mark.parametrize("raw", ["maybe", "", "2", 2, -1, "tru", 1.0, None, "y"])
def test_parse_bool_is_strict(raw):
    with pytest.raises(ConfigError) as excinfo:
        parse_bool(raw, "span_group_ids")
    assert "span_group_ids" in str(excinfo.value) and repr(raw) in str(excinfo.value)


@pytest.mark.parametrize("where", ["extra", "env"])
def test_group_ids_rejects_a_non_boolean(where):
    extra = {"span_group_ids": "maybe"} if where == "extra" else {}
    environ = {"MOONCAKE_SPAN_GROUP_IDS": "maybe"} if where == "env" else {}
    with pytest.raises(ConfigError, match="span_group_ids.*'maybe'"):
        load_span_options(extra, environ=environ)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"span_max_buffers_per_call": "lots"}, "span_max_buffers_per_call"),
        ({"span_max_buffers_per_call": 0}, "span_max_buffers_per_call"),
        ({"span_max_buffers_per_call": (1 << 20) + 1}, "1048576"),
        ({"storage_page_size": -64}, "storage_page_size"),
        ({"span_breaker_failures": 0}, "span_breaker_failures"),
        ({"span_breaker_probe_interval_s": 0}, "span_breaker_probe_interval_s"),
        ({"span_transfer_timeout_s": 0}, "span_transfer_timeout_s"),
        ({"span_transfer_timeout_s": 3601}, "span_transfer_timeout_s"),
        ({"span_replica_num": 0}, "span_replica_num"),
        ({"span_layout_guard": "zookeeper"}, "'zookeeper'"),
        ({"span_layout_guard": "etcd"}, "span_layout_guard_etcd"),
        ({"span_layout_guard_etcd": "no-port"}, "'no-port'"),
    ],
)
def test_bad_span_values(extra, fragment):
    with pytest.raises(ConfigError) as excinfo:
        load_span_options(extra, environ={})
    assert fragment in str(excinfo.value)


# Every range an option has: the first value outside it, the whole message (held
# verbatim: operators grep for these), and the boundary value it accepts.
RANGE_ERRORS = [
    ("storage_page_size", -1, ">= 0 tokens (0 = host page size), got -1", 0),
    ("span_max_buffers_per_call", 0, "in 1..1048576, got 0", 1),
    ("span_max_buffers_per_call", (1 << 20) + 1, "in 1..1048576, got 1048577", 1 << 20),
    ("span_breaker_failures", 0, ">= 1, got 0", 1),
    ("span_breaker_probe_interval_s", 0, "> 0, got 0.0", 0.001),
    ("span_transfer_timeout_s", 0, "in 1..3600 seconds, got 0", 1),
    ("span_transfer_timeout_s", 3601, "in 1..3600 seconds, got 3601", 3600),
    ("span_replica_num", 0, ">= 1, got 0", 1),
    ("span_segment_refresh_s", 0, "in (0, 86400] seconds, got 0.0", 0.001),
    ("span_domain_bad_ttl_s", 86401, "in (0, 86400] seconds, got 86401.0", 86400),
    ("span_lost_key_ttl_s", -1, "in (0, 86400] seconds, got -1.0", 86400),
    ("span_full_cooldown_s", -1, "in [0, 3600] seconds (0 disables), got -1.0", 0),
    ("span_full_cooldown_s", 3601, "in [0, 3600] seconds (0 disables), got 3601.0", 3600),
    ("span_chain_window_tokens", 0, "in 1..1073741824 tokens, got 0", 1),
    ("span_chain_window_tokens", (1 << 30) + 1, "in 1..1073741824 tokens, got 1073741825", 1 << 30),
    (
        "span_chain_stripe_tokens",
        -1,
        "in 0..1073741824 tokens (0: one node per window), got -1",
        0,
    ),
    ("span_chain_sample_every", -1, "in 0..1000000 (0: no chain records), got -1", 0),
    (
        "span_chain_sample_every",
        1_000_001,
        "in 0..1000000 (0: no chain records), got 1000001",
        1_000_000,
    ),
    ("span_lost_keys_max", 0, "in 1..10000000, got 0", 1),
    ("span_lost_keys_max", 10_000_001, "in 1..10000000, got 10000001", 10_000_000),
    ("span_staging_buffer_size", 4095, "in 4kb..1tb, got 4095 bytes", 4096),
    ("span_staging_buffer_size", (1 << 40) + 1, "in 4kb..1tb, got 1099511627777 bytes", 1 << 40),
]


@pytest.mark.parametrize(("key", "bad", "message", "boundary"), RANGE_ERRORS)
def test_every_range_names_its_key_and_bounds(key, bad, message, boundary):
    with pytest.raises(ConfigError) as excinfo:
        load_span_options({key: bad}, environ={})
    assert str(excinfo.value) == f"{key} must be {message}"
    load_span_options({key: boundary}, environ={})


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="MOONCAKE_SPAN_REPLICA_NUM"):
        load_span_options({}, environ={"MOONCAKE_SPAN_REPLICA_NUM": "two"})


def test_span_options_is_frozen_and_sources_do_not_affect_equality():
    options = load_span_options({"span_replica_num": 2}, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.replica_num = 3  # type: ignore[misc]
    assert options == SpanOptions(replica_num=2)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 1 << 20), st.one_of(st.none(), st.integers(1, 1 << 20)))
def test_max_buffers_extra_beats_env(extra_value, env_value):
    environ = {} if env_value is None else {"MOONCAKE_SPAN_MAX_BUFFERS_PER_CALL": str(env_value)}
    options = load_span_options({"span_max_buffers_per_call": extra_value}, environ=environ)
    assert options.max_buffers_per_call == extra_value


@pytest.mark.parametrize("bad", [2.7, True, "3.5", "ten"])
def test_integer_options_reject_non_integers(bad):
    from mooncake_span.config import load_span_options

    with pytest.raises(ConfigError, match="span_transfer_timeout_s"):
        load_span_options({"span_transfer_timeout_s": bad}, environ={})


# ---------------------------------------------------------------------------
# sglang 0.5.23 MooncakeStore keys, resolved per rank (issue 17)

TP8_RANK3 = RankInfo(tp_rank=3, tp_size=8)
NIC_MAP = json.dumps({str(r): f"mlx5_{r}" for r in range(8)})


def _extra(**keys):
    return {"master_server_address": EXTRA_MASTER, "protocol": "tcp", **keys}


@pytest.mark.parametrize(
    ("size", "ranks", "expected"),
    [
        ("8gb", TP8_RANK3, 1 << 30),
        (" 8GB ", TP8_RANK3, 1 << 30),
        (8 << 30, TP8_RANK3, 1 << 30),
        ("8gb", RankInfo(tp_rank=0, tp_size=4, pp_rank=1, pp_size=2), 1 << 30),
        ("8gb", RankInfo(), 8 << 30),
        ("8gb", None, 8 << 30),  # no storage config: not split, as upstream
        (1000, RankInfo(tp_size=3), 333),  # floor division, as upstream
    ],
)
def test_global_segment_size_is_per_server(size, ranks, expected):
    got = load_mooncake_settings(_extra(global_segment_size=size), environ={}, ranks=ranks)
    assert got.global_segment_size_bytes == expected


@pytest.mark.parametrize(
    ("device_name", "ranks", "expected"),
    [
        (NIC_MAP, TP8_RANK3, "mlx5_3"),
        (json.dumps({r: f"mlx5_{r}" for r in range(8)}), TP8_RANK3, "mlx5_3"),
        (json.dumps({"0": "mlx5_0"}), TP8_RANK3, ""),  # missing rank -> "" as upstream
        ("  " + NIC_MAP, TP8_RANK3, "mlx5_3"),
        (NIC_MAP, None, ""),
        ("mlx5_0,mlx5_1", TP8_RANK3, "mlx5_0,mlx5_1"),  # not a map: every rank uses it
        ("", TP8_RANK3, ""),
    ],
)
def test_device_name_map_resolves_this_ranks_nic(device_name, ranks, expected):
    got = load_mooncake_settings(_extra(device_name=device_name), environ={}, ranks=ranks)
    assert got.device_name == expected


@pytest.mark.parametrize(
    ("device_name", "fragment"),
    [
        ("{not json", "not a JSON rank -> NIC map"),
        ('{"0": ["mlx5_0"]}', "non-strings"),
        ({"0": "mlx5_0"}, "must be a string"),  # a JSON object, not JSON text: upstream crashes
    ],
)
def test_bad_device_maps_are_refused(device_name, fragment):
    with pytest.raises(ConfigError, match="device_name") as excinfo:
        load_mooncake_settings(_extra(device_name=device_name), environ={}, ranks=TP8_RANK3)
    assert fragment in str(excinfo.value)


def test_tenant_id_defaults_and_blank_means_default():
    assert load_mooncake_settings(_extra(), environ={}).tenant_id == "default"
    assert load_mooncake_settings(_extra(tenant_id="  "), environ={}).tenant_id == "default"
    assert load_mooncake_settings(_extra(tenant_id=" a "), environ={}).tenant_id == "a"
    env = {"MOONCAKE_MASTER": ENV_MASTER, "MOONCAKE_TENANT_ID": "t-env"}
    assert load_mooncake_settings(None, environ=env).tenant_id == "t-env"


def test_ssd_offload_path_gets_the_per_rank_subdir():
    ranks = RankInfo(tp_rank=3, tp_size=8, pp_rank=1, pp_size=2, dp_rank=2, attn_cp_rank=1)
    got = load_mooncake_settings(
        _extra(enable_ssd_offload=True, ssd_offload_path="/nvme/mc"), environ={}, ranks=ranks
    )
    assert got.enable_ssd_offload is True
    assert got.ssd_offload_path == "/nvme/mc/rank_2_3_1_1"
    assert (
        load_mooncake_settings(_extra(ssd_offload_path="/x"), environ={}).ssd_offload_path == "/x"
    )


def test_ssd_path_without_enable_is_passed_and_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="mooncake_span.config"):
        got = load_mooncake_settings(_extra(ssd_offload_path="/x"), environ={}, ranks=RankInfo())
    assert (got.enable_ssd_offload, got.ssd_offload_path) == (False, "/x/rank_0_0_0_0")
    assert any("enable_ssd_offload" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ({"check_server": "false"}, ["check_server", "'false'", "JSON true/false"]),
        ({"enable_ssd_offload": "yes"}, ["enable_ssd_offload"]),
        ({"ssd_offload_path": ""}, ["ssd_offload_path"]),
        ({"master_metrics_port": "nine"}, ["master_metrics_port"]),
        ({"master_metrics_port": 70000}, ["master_metrics_port", "70000"]),
        ({"tenant_id": ["a"]}, ["tenant_id"]),
        ({"client_server_address": "h:1"}, ["client_server_address", "standalone_storage"]),
    ],
)
def test_sglang_keys_with_bad_values_are_refused(override, fragments):
    with pytest.raises(ConfigError) as excinfo:
        load_mooncake_settings(_extra(**override), environ={})
    for fragment in fragments:
        assert fragment in str(excinfo.value)


def test_environment_flags_use_sglangs_words():
    env = {
        "MOONCAKE_MASTER": ENV_MASTER,
        "MOONCAKE_CHECK_SERVER": "Y",
        "MOONCAKE_ENABLE_SSD_OFFLOAD": "true",
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/ssd",
        "MOONCAKE_MASTER_METRICS_PORT": "9100",
        "MOONCAKE_DEVICE": NIC_MAP,
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "16gb",
    }
    got = load_mooncake_settings(None, environ=env, ranks=TP8_RANK3)
    assert got.check_server and got.enable_ssd_offload
    assert got.ssd_offload_path == "/ssd/rank_0_3_0_0"
    assert (got.master_metrics_port, got.device_name) == (9100, "mlx5_3")
    assert got.global_segment_size_bytes == 2 << 30
    assert got.admin_url() == "http://10.0.0.3:9100"
    with pytest.raises(ConfigError, match="MOONCAKE_CHECK_SERVER|check_server"):
        load_mooncake_settings(None, environ={**env, "MOONCAKE_CHECK_SERVER": "maybe"})


def test_env_is_not_read_for_keys_a_config_source_leaves_out():
    # Upstream reads only the defaults of MOONCAKE_* when a config source is
    # chosen (protocol excepted); so does the loader.
    env = {"MOONCAKE_DEVICE": "mlx5_9", "MOONCAKE_TENANT_ID": "t", "MOONCAKE_PROTOCOL": "tcp"}
    got = load_mooncake_settings({"master_server_address": EXTRA_MASTER}, environ=env)
    assert (got.device_name, got.tenant_id, got.protocol) == ("", "default", "tcp")


def test_admin_url_is_none_for_etcd_masters():
    got = load_mooncake_settings(
        _extra(master_server_address="etcd://e:2379", master_metrics_port=9100), environ={}
    )
    assert got.admin_url() is None


@pytest.mark.parametrize(
    ("group", "span", "expected"), [(True, None, True), (False, None, False), (None, None, True)]
)
def test_enable_group_semantics_sets_group_ids(group, span, expected):
    extra = {} if group is None else {"enable_group_semantics": group}
    assert load_span_options(extra, environ={}).group_ids is expected


def test_enable_group_semantics_contradicting_span_group_ids_is_refused():
    with pytest.raises(ConfigError, match="enable_group_semantics"):
        load_span_options({"enable_group_semantics": False, "span_group_ids": True}, environ={})


def test_sglang_keys_draw_no_stray_warning(caplog):
    # Every key sglang 0.5.23's MooncakeStore reads, spelled out here (not taken
    # from config.MOONCAKE_KEYS) so a key dropped from that set fails the test.
    upstream = (
        "master_server_address client_server_address standalone_storage local_hostname "
        "metadata_server global_segment_size local_buffer_size protocol device_name "
        "master_metrics_port check_server enable_ssd_offload ssd_offload_path tenant_id"
    )
    keys = {k: 1 for k in upstream.split()}
    with caplog.at_level(logging.WARNING, logger="mooncake_span.config"):
        load_span_options(keys, environ={})
    assert not caplog.records


@pytest.mark.parametrize(
    "ranks",
    [
        dict(tp_size=0),
        dict(tp_rank=8, tp_size=8),
        dict(pp_rank=2, pp_size=2),
        dict(dp_rank=-1),
    ],
)
def test_rank_info_validates(ranks):
    with pytest.raises(ConfigError):
        RankInfo(**ranks)
