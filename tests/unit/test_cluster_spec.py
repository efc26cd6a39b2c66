"""ClusterSpec validation and address checks; starts no process."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mooncake_span.ops.cluster import (
    ClusterSpec,
    ExternalCluster,
    LocalCluster,
    validate_master_address,
    validate_metadata_server,
)


def test_defaults_are_a_single_embedded_master():
    spec = ClusterSpec()
    assert spec.host == "127.0.0.1"
    assert spec.storage_nodes == 0
    assert spec.ha_masters == 1 and not spec.ha
    assert spec.metadata_mode == "embedded"
    assert spec.lease_ttl_ms is None and spec.client_ttl_s is None


def test_sizes_accept_strings_and_are_stored_as_ints():
    spec = ClusterSpec(storage_nodes=1, storage_node_segment_bytes="512mb")
    assert spec.storage_node_segment_bytes == 512 << 20


def test_spec_is_frozen_and_env_is_read_only():
    env = {"MC_TCP_STATUS_TIMEOUT_SEC": "5"}
    spec = ClusterSpec(env_overrides=env)
    env["LATER"] = "x"
    assert dict(spec.env_overrides) == {"MC_TCP_STATUS_TIMEOUT_SEC": "5"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.storage_nodes = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.env_overrides["X"] = "y"  # type: ignore[index]
    assert hash(spec) == hash(ClusterSpec(env_overrides={"OTHER": "1"}))


def test_metadata_mode_follows_ha_and_standalone():
    assert ClusterSpec(etcd=True, ha_masters=2).metadata_mode == "etcd"
    assert ClusterSpec(etcd=True).metadata_mode == "embedded"
    assert ClusterSpec(standalone_metadata=True).metadata_mode == "standalone"
    assert (
        ClusterSpec(etcd=True, ha_masters=3, standalone_metadata=True).metadata_mode == "standalone"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ha_masters": 2}, "needs etcd"),
        ({"ha_masters": 0}, "ha_masters"),
        ({"enable_oplog": True, "etcd": True}, "ha_masters >= 2"),
        ({"storage_nodes": -1}, "storage_nodes"),
        ({"storage_nodes": 1.5}, "storage_nodes"),
        ({"storage_nodes": True}, "storage_nodes"),
        ({"storage_nodes": 1, "storage_node_segment_bytes": 0}, "must be > 0"),
        ({"storage_node_segment_bytes": "lots"}, "'lots'"),
        ({"storage_node_segment_bytes": -5}, "-5"),
        ({"host": "localhost"}, "not an IP address"),
        ({"host": "::1"}, "IPv4"),
        ({"lease_ttl_ms": 0}, "lease_ttl_ms"),
        ({"client_ttl_s": -1}, "client_ttl_s"),
        ({"eviction_high_watermark_ratio": 0}, "eviction_high_watermark_ratio"),
        ({"eviction_high_watermark_ratio": 1.5}, "eviction_high_watermark_ratio"),
        ({"eviction_ratio": 0}, "eviction_ratio"),
        ({"eviction_ratio": True}, "eviction_ratio"),
        ({"master_extra_args": "--foo=1"}, "master_extra_args"),
        ({"master_extra_args": ("foo",)}, "master_extra_args"),
        ({"env_overrides": {"A=B": "x"}}, "env_overrides"),
        ({"env_overrides": {"A": 1}}, "env_overrides"),
        ({"start_timeout_s": 0}, "start_timeout_s"),
        ({"stop_timeout_s": -1}, "stop_timeout_s"),
    ],
)
def test_invalid_specs_raise_actionable_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec(**kwargs)


def test_valid_ha_spec():
    spec = ClusterSpec(etcd=True, ha_masters=2, enable_oplog=True, log_dir=Path("/tmp/x"))
    assert spec.ha


@pytest.mark.parametrize(
    "address", ["127.0.0.1:50051", "etcd://127.0.0.1:2379", "etcd://10.0.0.1:2379;10.0.0.2:2379"]
)
def test_valid_master_addresses(address):
    assert validate_master_address(address) == address


@pytest.mark.parametrize(
    "address", ["", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:x", "http://127.0.0.1:1", ":50051"]
)
def test_invalid_master_addresses(address):
    with pytest.raises(ValueError, match="master address"):
        validate_master_address(address)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/metadata",
        "https://meta.example:443/metadata",
        "etcd://127.0.0.1:2379",
        "127.0.0.1:2379",
        "P2PHANDSHAKE",
    ],
)
def test_valid_metadata_servers(url):
    assert validate_metadata_server(url) == url


@pytest.mark.parametrize(
    "url", ["", "foo://127.0.0.1:1", "redis://h:1", "http://nohost/metadata", "p2phandshake"]
)
def test_invalid_metadata_servers_are_rejected_before_native_setup(url):
    with pytest.raises(ValueError, match="metadata server"):
        validate_metadata_server(url)


def test_external_cluster_has_the_client_api():
    cluster = ExternalCluster("10.0.0.5:50051", "http://10.0.0.5:8080/metadata", host="10.0.0.9")
    assert cluster.client_config(global_segment_size_bytes="1gb") == {
        "master_server_address": "10.0.0.5:50051",
        "metadata_server": "http://10.0.0.5:8080/metadata",
        "protocol": "tcp",
        "local_hostname": "10.0.0.9",
        "global_segment_size": 1 << 30,
    }
    assert cluster.client_env() == {"MC_TCP_BIND_ADDRESS": "10.0.0.9"}
    with pytest.raises(ValueError):
        ExternalCluster("10.0.0.5:50051", "foo://x")


def test_unstarted_cluster_has_no_addresses():
    cluster = LocalCluster()
    assert not cluster.started
    with pytest.raises(RuntimeError, match="start"):
        _ = cluster.master_address
    assert cluster.pids() == {}


def test_storage_node_rejects_bad_urls_before_touching_mooncake(capsys):
    from mooncake_span import storage_node

    with pytest.raises(SystemExit) as excinfo:
        storage_node.main(
            ["--master=127.0.0.1:5", "--metadata=foo://127.0.0.1:1", "--segment-bytes=1mb"]
        )
    assert excinfo.value.code == 2
    assert "scheme 'foo' is not supported" in capsys.readouterr().err


def _node_settings(argv, environ):
    from mooncake_span.ops import storage_process

    args = storage_process.build_parser().parse_args(argv)
    return storage_process.settings_from_args(args, environ)


def test_storage_node_flags_build_mooncake_settings():
    settings = _node_settings(
        ["--master=10.0.0.1:50051", "--metadata=http://10.0.0.1:8080/metadata"]
        + ["--segment-bytes=512mb", "--host=10.0.0.7"],
        {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.99"},
    )
    assert settings.master_server_address == "10.0.0.1:50051"
    assert settings.metadata_server == "http://10.0.0.1:8080/metadata"
    assert settings.global_segment_size_bytes == 512 << 20
    assert settings.local_buffer_size_bytes == 16 << 20
    assert settings.protocol == "tcp" and settings.device_name == ""
    assert settings.local_hostname == "10.0.0.7"  # --host beats the environment


def test_storage_node_reads_the_serving_nodes_environment():
    environ = {
        "MOONCAKE_MASTER": "etcd://10.0.0.1:2379",
        "MOONCAKE_TE_META_DATA_SERVER": "etcd://10.0.0.1:2379",
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2gb",
        "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.5",
    }
    settings = _node_settings([], environ)
    assert settings.source == "environment"
    assert settings.master_server_address == "etcd://10.0.0.1:2379"
    assert settings.global_segment_size_bytes == 2 << 30
    assert settings.local_hostname == "10.0.0.5"
    assert _node_settings(["--segment-bytes=1gb"], environ).global_segment_size_bytes == 1 << 30


def test_storage_node_reads_the_config_file(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(
        '{"master_server_address": "10.0.0.1:50051", "metadata_server": "P2PHANDSHAKE",'
        ' "protocol": "tcp", "global_segment_size": "1gb"}'
    )
    settings = _node_settings([], {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(path)})
    assert settings.source == f"file {path}"
    assert settings.global_segment_size_bytes == 1 << 30


@pytest.mark.parametrize(
    "argv, environ, message",
    [
        ([], {}, "pass --master"),
        (["--master=10.0.0.1:1"], {}, "--segment-bytes is required"),
        (["--master=10.0.0.1:1", "--segment-bytes=0"], {}, "must be > 0"),
        (["--master=10.0.0.1:1", "--segment-bytes=1xb"], {}, "--segment-bytes"),
        (["--master=10.0.0.1:1", "--segment-bytes=1mb", "--protocol=udp"], {}, "'udp'"),
        (["--master=nohost", "--segment-bytes=1mb"], {}, "nohost"),
        ([], {"MOONCAKE_MASTER": "10.0.0.1:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0"}, "> 0"),
    ],
)
def test_storage_node_rejects_bad_settings_with_the_value(argv, environ, message):
    from mooncake_span.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        _node_settings(argv, environ)


def test_cluster_up_starts_masters_with_the_measured_eviction_flags():
    from mooncake_span.ops.cli import build_parser, cluster_spec_from_args
    from mooncake_span.ops.cluster_spec import (
        CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO,
        CLUSTER_UP_EVICTION_RATIO,
        CLUSTER_UP_LEASE_TTL_MS,
        SSD_EVICTION_HIGH_WATERMARK_RATIO,
        SSD_EVICTION_RATIO,
        SSD_LEASE_TTL_MS,
    )

    spec = cluster_spec_from_args(build_parser().parse_args(["cluster", "up"]))
    assert (
        spec.master_lease_ttl_ms,
        spec.master_eviction_high_watermark_ratio,
        spec.master_eviction_ratio,
    ) == (
        CLUSTER_UP_LEASE_TTL_MS,
        CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO,
        CLUSTER_UP_EVICTION_RATIO,
    )
    ssd = ["cluster", "up", "--ssd-dir", "/nvme/cache"]
    spec = cluster_spec_from_args(build_parser().parse_args(ssd))
    assert (
        spec.master_lease_ttl_ms,
        spec.master_eviction_high_watermark_ratio,
        spec.master_eviction_ratio,
    ) == (SSD_LEASE_TTL_MS, SSD_EVICTION_HIGH_WATERMARK_RATIO, SSD_EVICTION_RATIO)
    given = build_parser().parse_args([*ssd, "--lease-ttl-ms", "700"])
    assert cluster_spec_from_args(given).master_lease_ttl_ms == 700
    args = build_parser().parse_args(["cluster", "up", "--eviction-ratio", "0.2"])
    assert args.eviction_ratio == 0.2


def test_cluster_up_ssd_check_reaches_each_node_only_when_given():
    from mooncake_span.ops.cli import build_parser, cluster_spec_from_args
    from mooncake_span.ops.launcher import NodeSsdArgs

    ssd = ["cluster", "up", "--ssd-dir", "/nvme/cache"]
    assert cluster_spec_from_args(build_parser().parse_args(ssd)).ssd_check is None
    spec = cluster_spec_from_args(build_parser().parse_args([*ssd, "--ssd-check", "full"]))
    assert spec.ssd_check == "full"
    # Not given: no flag, so the node reads MOONCAKE_SPAN_SSD_CHECK it inherits.
    assert not any("ssd-check" in a for a in NodeSsdArgs(Path("/n"), "node0").argv())
    assert "--ssd-check=full" in NodeSsdArgs(Path("/n"), "node0", check="full").argv()
    with pytest.raises(ValueError, match="ssd_check must be one of"):
        ClusterSpec(storage_nodes=1, ssd_dir="/n", ssd_check="quick")
    with pytest.raises(ValueError, match="ssd_check needs ssd_dir"):
        ClusterSpec(ssd_check="full")


def test_fault_helpers_name_an_index_out_of_range():
    from mooncake_span.ops import cluster as ops_cluster

    cluster = LocalCluster(ClusterSpec())
    cluster._ports = ops_cluster._Ports((50051,), (9003,), 8080, None, None)
    cluster._started = True
    try:
        with pytest.raises(IndexError, match=r"master index 1 out of range \(ha_masters=1\)"):
            cluster.kill_master(1)
        with pytest.raises(IndexError, match=r"node index 0 out of range \(storage_nodes=0\)"):
            cluster.kill_storage_node(0)
    finally:
        cluster._started = False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--storage-nodes", "0"], None),
        (["--storage-nodes", "-1"], "--storage-nodes: expected an integer >= 0, got -1"),
        (["--ha-masters", "0"], "--ha-masters: expected an integer >= 1, got 0"),
        (["--lease-ttl-ms", "x"], "--lease-ttl-ms: expected an integer, got 'x'"),
    ],
)
def test_cluster_up_count_flags_name_their_bound(capsys, argv, message):
    from mooncake_span.ops.cli import build_parser

    if message is None:
        assert build_parser().parse_args(["cluster", "up", *argv]).storage_nodes == 0
        return
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cluster", "up", *argv])
    assert message in capsys.readouterr().err
