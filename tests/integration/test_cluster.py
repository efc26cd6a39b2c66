"""Tests of the cluster launcher: lifecycle, faults, and `mooncake-span cluster up`.

Each test runs its own small cluster (64 MB nodes) so that killing processes
cannot disturb the session cluster other tests share.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mooncake_span.ops.cluster import ClusterSpec, LocalCluster

_NODE_SEGMENT_BYTES = 64 << 20
_VALUE_BYTES = 256 << 10
_SUMMARY_TIMEOUT_S = 30.0


def _process_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            state = stat_file.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != b"Z"


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat_file:
                fields = stat_file.read().rsplit(b")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # fields[0] is the state, fields[2] the process group id.
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry))
    return members


def _assert_all_gone(pids: dict[str, int]) -> None:
    alive = {name: pid for name, pid in pids.items() if _process_exists(pid)}
    assert not alive, f"processes left behind: {alive}"
    groups = {name: _group_members(pid) for name, pid in pids.items()}
    assert not any(groups.values()), f"process-group members left behind: {groups}"


@contextlib.contextmanager
def _client(config: dict) -> Iterator[object]:
    """A gseg=0 client, closed exactly once on exit."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        local_hostname=config["local_hostname"],
        metadata_server=config["metadata_server"],
        global_segment_size=config["global_segment_size"],
        local_buffer_size=16 << 20,
        protocol=config["protocol"],
        rdma_devices="",
        master_server_addr=config["master_server_address"],
    )
    assert rc == 0, f"setup returned {rc} for {config}"
    try:
        yield store
    finally:
        store.close()


def _put(store, key: str, value: np.ndarray) -> int:
    return store.batch_put_from_multi_buffers([key], [[value.ctypes.data]], [[value.nbytes]])[0]


def _get(store, key: str, nbytes: int) -> tuple[int, np.ndarray]:
    out = np.zeros(nbytes, dtype=np.uint8)
    rc = store.batch_get_into_multi_buffers([key], [[out.ctypes.data]], [[nbytes]])[0]
    return rc, out


def _random_bytes(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, _VALUE_BYTES, dtype=np.uint8)


@pytest.mark.integration
def test_start_health_and_teardown_leaves_no_process(tmp_path):
    spec = ClusterSpec(
        storage_nodes=2, storage_node_segment_bytes=_NODE_SEGMENT_BYTES, log_dir=tmp_path
    )
    cluster = LocalCluster(spec)
    with cluster:
        pids = cluster.pids()
        assert set(pids) == {"master0", "node0", "node1"}
        assert all(_process_exists(pid) for pid in pids.values())

        with urllib.request.urlopen(cluster.metrics_url + "/health", timeout=5) as response:
            health = json.loads(response.read())
        assert health["role"] == "leader" and health["service_ready"] is True
        # The master's summary counts clients as they renew; under load the
        # second node's first renewal can come a moment after it is READY.
        deadline = time.monotonic() + _SUMMARY_TIMEOUT_S
        while "Clients: 2" not in (summary := cluster.summary()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "role=leader" in summary and "Clients: 2" in summary
        assert cluster.leader_index() == 0

        host, port = cluster.master_address.rsplit(":", 1)
        assert host == "127.0.0.1" and port.isdigit()
        assert cluster.metadata_server.startswith("http://127.0.0.1:")
        assert cluster.metadata_server.endswith("/metadata")
        assert cluster.etcd_endpoint is None
        assert cluster.client_config(global_segment_size_bytes="1mb") == {
            "master_server_address": cluster.master_address,
            "metadata_server": cluster.metadata_server,
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
            "global_segment_size": 1 << 20,
            "span_master_admin_url": cluster.metrics_url,
        }
        assert cluster.client_env()["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
        for name in ("master0", "node0", "node1"):
            assert (tmp_path / f"{name}.log").stat().st_size > 0

    assert cluster.pids() == {}
    _assert_all_gone(pids)
    cluster.stop()  # idempotent
    with pytest.raises(RuntimeError, match="start"):
        _ = cluster.master_address


@pytest.mark.integration
def test_restart_of_killed_storage_node(tmp_path):
    # A short client TTL makes the master forget the dead node's segment
    # quickly, so new puts stop being placed on it.
    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=_NODE_SEGMENT_BYTES,
        client_ttl_s=2,
        log_dir=tmp_path,
    )
    with LocalCluster(spec) as cluster, _client(cluster.client_config()) as store:
        before = _random_bytes(1)
        assert _put(store, "before-kill", before) == 0

        old_pid = cluster.pids()["node0"]
        cluster.kill_storage_node(0)
        assert "node0" not in cluster.pids()
        _assert_all_gone({"node0": old_pid})

        cluster.restart_storage_node(0)
        new_pid = cluster.pids()["node0"]
        assert new_pid != old_pid

        after = _random_bytes(2)
        deadline = time.monotonic() + 20
        attempt = 0
        while True:
            key = f"after-restart-{attempt}"
            rc = _put(store, key, after)
            if rc == 0 or time.monotonic() > deadline:
                break
            attempt += 1
            time.sleep(0.2)
        assert rc == 0, f"puts kept failing after the node restart (last rc {rc})"
        get_rc, out = _get(store, key, after.nbytes)
        assert get_rc == after.nbytes
        np.testing.assert_array_equal(out, after)
    _assert_all_gone({"node0": new_pid})


@pytest.mark.integration
def test_cli_cluster_up_serves_until_sigint(tmp_path):
    stdout_path = tmp_path / "cli.out"
    with open(stdout_path, "wb") as stdout_file:
        cli = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mooncake_span.ops.cli",
                "cluster",
                "up",
                "--storage-nodes=1",
                "--segment-size=64mb",
                f"--log-dir={tmp_path / 'logs'}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=stdout_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        output = _wait_for_line(cli, stdout_path, "ready; press Ctrl-C to stop", timeout_s=60)
        lines = output.splitlines()
        extra_config = json.loads(next(line for line in lines if line.startswith("{")))
        pids = json.loads(next(line for line in lines if line.startswith("pids:")).split(":", 1)[1])
        assert set(pids) == {"master0", "node0"}
        assert "export MC_TCP_BIND_ADDRESS=127.0.0.1" in lines
        assert extra_config["protocol"] == "tcp" and extra_config["global_segment_size"] == 0

        value = _random_bytes(3)
        with _client(extra_config) as store:
            assert _put(store, "via-cli", value) == 0
            rc, out = _get(store, "via-cli", value.nbytes)
            assert rc == value.nbytes
            np.testing.assert_array_equal(out, value)

        cli.send_signal(signal.SIGINT)
        assert cli.wait(timeout=60) == 0
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
    assert "cluster stopped" in stdout_path.read_text()
    _assert_all_gone(pids)


def _wait_for_line(proc: subprocess.Popen, path: Path, marker: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = path.read_text(errors="replace")
        if marker in text:
            return text
        if proc.poll() is not None:
            pytest.fail(f"CLI exited with {proc.returncode} before {marker!r}:\n{text}")
        if time.monotonic() > deadline:
            pytest.fail(f"CLI printed no {marker!r} within {timeout_s}s:\n{text}")
        time.sleep(0.1)


@pytest.mark.integration
@pytest.mark.slow
def test_ha_failover_promotes_standby_and_restart_rejoins(tmp_path):
    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=_NODE_SEGMENT_BYTES,
        etcd=True,
        ha_masters=2,
        log_dir=tmp_path,
        # A storage node's close() in etcd mode waits on a 30 s etcd watch;
        # its data is thrown away anyway.
        stop_timeout_s=3,
    )
    with LocalCluster(spec) as cluster:
        etcd_port = cluster.etcd_endpoint.rsplit(":", 1)[1]
        assert cluster.master_address == f"etcd://127.0.0.1:{etcd_port}"
        assert cluster.metadata_server == f"etcd://127.0.0.1:{etcd_port}"
        assert cluster.leader_index() == 0
        assert "role=standby" in cluster.summary(1)

        cluster.kill_master(0)
        assert cluster.wait_for_leader(timeout_s=40) == 1
        # The storage node remounts its segment on the new leader by itself.
        deadline = time.monotonic() + 20
        while "Mem Storage: 0 B / 0 B" in cluster.summary(1):
            assert time.monotonic() < deadline, cluster.summary(1)[:300]
            time.sleep(0.2)

        cluster.restart_master(0)
        assert cluster.leader_index() == 1
        assert "role=standby" in cluster.summary(0)
        pids = cluster.pids()
        assert set(pids) == {"etcd", "master0", "master1", "node0"}
    _assert_all_gone(pids)


def test_spec_rejects_ha_without_etcd():
    with pytest.raises(ValueError, match="etcd=True"):
        ClusterSpec(ha_masters=2)


def test_fault_helpers_need_a_started_cluster():
    cluster = LocalCluster(ClusterSpec(storage_nodes=1))
    with pytest.raises(RuntimeError, match="start"):
        cluster.kill_storage_node(0)
    with pytest.raises(RuntimeError, match="start"):
        cluster.restart_master(0)
    cluster.stop()  # stopping a never-started cluster is a no-op
