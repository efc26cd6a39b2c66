"""The shared launcher: command lines, readiness checks and one ClusterStartError.

Processes started here are tiny shell commands, not Mooncake servers (those are
covered by tests/integration/test_cluster.py and tests/netns).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from mooncake_span.ops import cluster as ops_cluster
from mooncake_span.ops import launcher as L
from mooncake_span_tools.lab import netns
from mooncake_span_tools.lab import netns_cluster as lab_cluster


def test_one_cluster_start_error_for_both_cluster_kinds():
    assert ops_cluster.ClusterStartError is L.ClusterStartError
    assert lab_cluster.ClusterStartError is L.ClusterStartError
    assert netns.ClusterStartError is L.ClusterStartError
    assert issubclass(L.EarlyExitError, L.ClusterStartError)


def test_master_argv_embedded_metadata_and_tunables():
    args = L.MasterArgs(
        host="10.1.2.3",
        rpc_port=5001,
        metrics_port=9001,
        http_metadata_port=8081,
        lease_ttl_ms=500,
        client_ttl_s=4,
        eviction_high_watermark_ratio=0.5,
        eviction_ratio=0.1,
        extra_args=("--foo=1",),
    )
    argv = args.argv("/bin/mooncake_master")
    assert argv[0] == "/bin/mooncake_master"
    assert "--rpc_port=5001" in argv and "--rpc_address=10.1.2.3" in argv
    assert "--metrics_port=9001" in argv and "--metrics_host=10.1.2.3" in argv
    assert "--enable_http_metadata_server=true" in argv
    assert "--http_metadata_server_port=8081" in argv
    assert "--default_kv_lease_ttl=500" in argv and "--client_ttl=4" in argv
    assert "--eviction_high_watermark_ratio=0.5" in argv and "--eviction_ratio=0.1" in argv
    assert argv[-1] == "--foo=1"
    assert not any(a.startswith("--enable_ha") for a in argv)


def test_master_argv_ha_has_no_embedded_metadata():
    argv = L.MasterArgs(
        host="127.0.0.1", rpc_port=1, metrics_port=2, ha_etcd_endpoint="127.0.0.1:2379"
    ).argv("m")
    assert "--enable_ha=true" in argv and "--ha_backend_connstring=127.0.0.1:2379" in argv
    assert "--enable_oplog=true" not in argv
    assert not any("http_metadata" in a for a in argv)
    with_oplog = L.MasterArgs(
        host="127.0.0.1", rpc_port=1, metrics_port=2, ha_etcd_endpoint="e:1", enable_oplog=True
    ).argv("m")
    assert "--enable_oplog=true" in with_oplog


def test_etcd_and_storage_node_argv(tmp_path):
    argv = L.etcd_argv(
        "etcd", member="x", data_dir=tmp_path, host="1.2.3.4", client_port=1, peer_port=2
    )
    assert "--listen-client-urls=http://1.2.3.4:1" in argv
    assert "--initial-cluster=x=http://1.2.3.4:2" in argv
    node = L.storage_node_argv(
        master="m:1",
        metadata="http://m:2/metadata",
        segment_bytes=5,
        local_buffer_bytes=6,
        host="h",
    )
    assert node[:3] == [sys.executable, "-m", "mooncake_span.storage_node"]
    assert "--segment-bytes=5" in node and "--host=h" in node


def test_local_and_namespace_clusters_build_the_same_master_flags():
    local = ops_cluster.LocalCluster(ops_cluster.ClusterSpec(client_ttl_s=3))
    local._ports = ops_cluster._Ports((50051,), (9003,), 8080, None, None)
    local._started = True
    topology = netns.NetnsTopology(netns.TopologySpec(hosts=("master", "store1")))
    remote = netns.NetnsCluster(
        topology, netns.NetnsClusterSpec(storage_hosts=("store1",), client_ttl_s=3)
    )

    def flags(args: L.MasterArgs) -> list[str]:
        # Addresses differ by design (loopback vs the namespace's address).
        return [a for a in args.argv("m") if "127.0.0.1" not in a and "198.18." not in a]

    try:
        assert flags(local._master_args(0)) == flags(remote._master_args(0))
        # Clients of either cluster get the same sglang extra-config keys.
        assert local.client_config(0).keys() == remote.client_config("store1").keys()
        assert remote.client_config("store1")["local_hostname"] == topology.address("store1")
    finally:
        local._started = False


@pytest.mark.parametrize(
    "answer, expected",
    [
        ((200, '{"role": "leader", "service_ready": true}'), {"role": "leader"}),
        ((503, '{"role": "leader"}'), None),
        ((200, "not json"), None),
        ((200, "[1, 2]"), None),
        (None, None),
    ],
)
def test_parse_health(answer, expected):
    health = L.parse_health(answer)
    if expected is None:
        assert health is None
    else:
        assert health is not None and health["role"] == expected["role"]


def test_wait_for_leader_returns_the_serving_leader_and_times_out():
    states = iter(
        [
            [None, {"role": "standby"}],
            [{"role": "leader", "service_ready": False}, None],
            [None, {"role": "leader", "service_ready": True}],
        ]
    )
    assert L.wait_for_leader(lambda: next(states), timeout_s=5.0) == 1
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="serving leader"):
        L.wait_for_leader(lambda: [{"role": "standby"}], timeout_s=0.3)
    assert time.monotonic() - started < 3.0


class _Site(L.LocalSite):
    """A local site whose HTTP probe answers from a script instead of the network."""

    def __init__(self, log_dir: Path, answers: list):
        super().__init__(log_dir, {"PATH": "/usr/bin:/bin"})
        self.answers = answers

    def http_get(self, url: str, timeout_s: float):
        return self.answers.pop(0) if self.answers else None


def test_wait_master_needs_service_ready_when_serving(tmp_path):
    site = _Site(
        tmp_path,
        [None, (200, '{"service_ready": false}'), (200, '{"service_ready": true}')],
    )
    process = site.start("m", ["sleep", "30"])
    try:
        L.wait_master(process, site, "http://x", time.monotonic() + 10, serving=True)
        assert site.answers == []
    finally:
        L.terminate([process], 15, 2.0)


def test_wait_http_reports_an_early_exit_with_the_log_tail(tmp_path):
    site = _Site(tmp_path, [])
    process = site.start("etcd", ["sh", "-c", "echo bind: address already in use; exit 3"])
    with pytest.raises(L.EarlyExitError, match="code 3") as info:
        L.wait_http(process, site, "http://x/health", time.monotonic() + 10, L.etcd_healthy)
    assert "address already in use" in str(info.value)
    L.terminate([process], 15, 1.0)


def test_wait_http_times_out_naming_the_process(tmp_path):
    site = _Site(tmp_path, [(500, "no")] * 1000)
    process = site.start("metadata", ["sleep", "30"])
    try:
        with pytest.raises(L.ClusterStartError, match="metadata did not answer") as info:
            L.wait_http(process, site, "http://x", time.monotonic() + 0.3, lambda s, b: s == 200)
        assert not isinstance(info.value, L.EarlyExitError)
    finally:
        L.terminate([process], 15, 2.0)


def test_ready_line_only_counts_the_current_run(tmp_path):
    site = _Site(tmp_path, [])
    process = site.start("node0", ["sh", "-c", "echo READY pid=1"])
    L.wait_ready_line(process, time.monotonic() + 10)
    assert process.wait_exit(5.0)
    process.reap()
    # A restart appends to the same log; the old READY line must not count.
    process.argv = ["sh", "-c", "echo setup failed; exit 1"]
    process.start()
    with pytest.raises(L.EarlyExitError, match="before READY"):
        L.wait_ready_line(process, time.monotonic() + 10)
    L.terminate([process], 15, 1.0)
    assert "READY pid=1" in (tmp_path / "node0.log").read_text()


def test_start_masters_records_each_process_before_waiting(tmp_path):
    site = _Site(tmp_path, [None] * 1000)
    recorded: dict[int, L.LocalProcess] = {}
    with pytest.raises(L.ClusterStartError):
        L.start_masters(
            lambda i: site,
            ["master0", "master1"],
            [["sleep", "30"], ["sleep", "30"]],
            ["http://a", "http://b"],
            time.monotonic() + 0.3,
            recorded.__setitem__,
        )
    # master0 never served, so master1 was never started; master0 is known and can be stopped.
    assert list(recorded) == [0]
    L.terminate(recorded.values(), 15, 2.0)
    assert not recorded[0].running()
