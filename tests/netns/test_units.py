"""Pure checks of the topology spec, the cluster spec and the worker's helpers (no root needed)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
from pathlib import Path

import pytest

from mooncake_span_tools.lab.netns import NetnsClusterSpec, TopologySpec
from tests.netns.node_worker import (
    Geometry,
    WorkerConfig,
    node_variant,
    page_content,
    page_seed,
    parse_request_ids,
    request_tokens,
)


def test_topology_names_and_addresses():
    spec = TopologySpec(run_id="0a1b2c")
    assert spec.bridge_namespace == "msp0a1b2c-br"
    assert spec.namespace("prefill") == "msp0a1b2c-prefill"
    assert [spec.address(h) for h in spec.hosts] == [f"198.18.0.{i}" for i in range(1, 6)]
    assert spec.bridge_port("store2") == "v-store2"
    assert all(len(spec.bridge_port(h)) <= 15 for h in spec.hosts)  # Linux IFNAMSIZ
    assert spec.namespaces()[0] == spec.bridge_namespace and len(spec.namespaces()) == 6


def test_topology_run_ids_are_random():
    assert TopologySpec().run_id != TopologySpec().run_id


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hosts": ()},
        {"hosts": ("a", "a")},
        {"hosts": ("Master",)},
        {"hosts": ("br",)},
        {"hosts": ("averyveryverylongname",)},
        {"subnet": "10.0.0.0/24"},  # outside the benchmarking range
        {"subnet": "198.18.0.0/30", "hosts": ("a", "b", "c")},  # too small
        {"prefix": "MSP"},
        {"run_id": "xyz"},
    ],
)
def test_topology_spec_rejects(kwargs):
    with pytest.raises(ValueError):
        TopologySpec(**kwargs)


def test_topology_unknown_host():
    with pytest.raises(KeyError, match="unknown host"):
        TopologySpec().address("nowhere")


def test_subnet_stays_in_benchmark_range():
    spec = TopologySpec(subnet="198.19.7.0/24", hosts=("a", "b"))
    assert ipaddress.ip_address(spec.address("b")) in ipaddress.ip_network("198.18.0.0/15")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"master_hosts": ("master", "master2")}, "needs etcd"),
        ({"enable_oplog": True}, "enable_oplog"),
        ({"master_hosts": ()}, "at least one"),
        ({"segment_bytes": 0}, "segment_bytes"),
        ({"port_offset": -1}, "port_offset"),
        ({"client_ttl_s": 0}, "client_ttl_s"),
    ],
)
def test_cluster_spec_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NetnsClusterSpec(**kwargs)


def test_cluster_spec_sizes_and_ha():
    spec = NetnsClusterSpec(
        master_hosts=("a", "b"), etcd_host="a", segment_bytes="64mb", enable_oplog=True
    )
    assert spec.segment_bytes == 64 << 20 and spec.ha
    assert spec.hosts_used() == {"a", "b", "store1", "store2"}


def test_request_ids():
    assert parse_request_ids("0-3,10,12-13") == (0, 1, 2, 3, 10, 12, 13)
    for bad in ("", "3-1", "a", "1,1", "-2"):
        with pytest.raises(ValueError):
            parse_request_ids(bad)


def test_content_is_deterministic_and_distinct():
    assert page_content(page_seed(1, "kv", "abc", 0), 4096) == page_content(
        page_seed(1, "kv", "abc", 0), 4096
    )
    assert page_content(page_seed(1, "kv", "abc", 0), 64) != page_content(
        page_seed(1, "kv", "abc", 1), 64
    )
    assert page_content(page_seed(1, "kv", "abc", 0), 64) != page_content(
        page_seed(1, "indexer", "abc", 0), 64
    )
    assert page_content(page_seed(1, "kv", "abc", 0), 64) != page_content(
        page_seed(2, "kv", "abc", 0), 64
    )


def test_shared_prefix_tokens():
    g = Geometry()
    a = request_tokens(7, 0, g, keys=4, shared_keys=2)
    b = request_tokens(7, 1, g, keys=4, shared_keys=2)
    page = g.storage_page_tokens
    assert len(a) == 4 * page
    assert a[: 2 * page] == b[: 2 * page] and a[2 * page :] != b[2 * page :]
    assert request_tokens(7, 0, g, 4, 0) == request_tokens(7, 0, g, 4, 0)


def test_node_variants():
    base = WorkerConfig(
        mode="probe", master="h:1", metadata="http://h:2/metadata", local_hostname="h"
    )
    v = node_variant(base, "layers=3,storage_page_tokens=512,layout_guard=etcd")
    assert (v.geometry.layers, v.geometry.storage_page_tokens, v.layout_guard) == (3, 512, "etcd")
    assert node_variant(base, "") == base
    for bad in ("layers", "nope=1", "layers=x", "storage_page_tokens=100"):
        with pytest.raises(ValueError):
            node_variant(base, bad)


def test_worker_config_rejects():
    common = {"master": "h:1", "metadata": "http://h:2/metadata", "local_hostname": "h"}
    with pytest.raises(ValueError, match="kill-marker"):
        WorkerConfig(mode="failover", **common)
    with pytest.raises(ValueError, match="probe mode"):
        WorkerConfig(mode="read", variants=("layers=3",), **common)
    with pytest.raises(ValueError, match="shared_prefix_keys"):
        WorkerConfig(mode="write", shared_prefix_keys=5, **common)
    with pytest.raises(ValueError, match="exit mode"):
        WorkerConfig(mode="write", exit_mode="later", **common)


def _repo() -> Path:
    return Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["single-node", "prefill-decode", "ha-etcd"])
def test_configs_load_cleanly(name, caplog):
    """Each shipped config parses with the backend's own loaders and names no stray key."""
    from mooncake_span.config import load_span_options
    from mooncake_span.mooncake_settings import load_mooncake_settings

    values = json.loads((_repo() / "configs" / f"{name}.json").read_text())
    assert {"backend_name", "module_path", "class_name", "interface_v1"} <= set(values)
    assert (values["module_path"], values["class_name"]) == (
        "mooncake_span.sglang_backend",
        "MooncakeSpanStore",
    )
    with caplog.at_level("WARNING"):
        settings = load_mooncake_settings(values, environ={})
        options = load_span_options(values, environ={})
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert settings.global_segment_size_bytes == 0
    assert options.storage_page_size is None
    if name == "ha-etcd":
        assert settings.master_server_address.startswith("etcd://")
        assert settings.metadata_server.startswith("etcd://")


@pytest.mark.parametrize(
    "script", ["netns_cluster.sh", "mooncake_single.sh", "mooncake_pd_storage.sh", "mooncake_ha.sh"]
)
def test_scripts_have_help(script):
    result = subprocess.run(
        ["bash", str(_repo() / "scripts" / script), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")


def test_missing_namespaces_skip_locally_and_fail_under_ci(monkeypatch):
    import tests.conftest as root_conftest

    root_conftest._netns_reason.cache_clear()
    monkeypatch.setattr(
        "mooncake_span_tools.lab.netns.netns_unavailable_reason", lambda: "not root"
    )
    try:
        monkeypatch.delenv("CI", raising=False)
        with pytest.raises(pytest.skip.Exception, match="not root"):
            root_conftest.require_netns()
        monkeypatch.setenv("CI", "1")
        with pytest.raises(pytest.fail.Exception, match="CI is set"):
            root_conftest.require_netns()
    finally:
        root_conftest._netns_reason.cache_clear()
