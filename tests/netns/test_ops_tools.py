"""doctor and inspect from one host of the namespace topology against the others.

The client host (``decode``) reaches the master, metadata server and etcd on
``master`` and the storage nodes on ``store1``/``store2`` over the bridge, as
on a real cluster: the round trip crosses hosts, etcd is the layout guard's,
and a loopback bind address on this host is caught because the master is
remote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import checkout

pytestmark = [pytest.mark.netns, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
HOST = "decode"


def _run_cli(topology, cluster, *argv: str, env: dict[str, str] | None = None):
    full_env = {
        **os.environ,
        **topology.host_env(HOST),
        "PYTHONPATH": checkout.PYTHONPATH,
        **(env or {}),
    }
    cmd = topology.exec_argv(HOST, [sys.executable, "-m", "mooncake_span.ops.cli", *argv])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=full_env, cwd=REPO)


def _extra(topology, cluster) -> str:
    config = cluster.client_config(HOST)
    config.update(span_layout_guard="etcd", span_layout_guard_etcd=cluster.etcd_endpoint)
    return json.dumps(config)


def _doctor(topology, cluster, env=None):
    result = _run_cli(
        topology,
        cluster,
        "doctor",
        "--json",
        "--extra-config",
        _extra(topology, cluster),
        "--admin-url",
        cluster.metrics_url(),
        env=env,
    )
    doc = json.loads(result.stdout)
    return result.returncode, doc, {c["name"]: c for c in doc["checks"]}


def test_doctor_across_hosts(pd_topology, pd_cluster, figures):
    rc, doc, checks = _doctor(pd_topology, pd_cluster)
    assert rc == 0, doc
    for name in ("master", "master admin", "metadata", "etcd", "bind address", "round trip"):
        assert checks[name]["status"] == "PASS", checks[name]
    assert pd_topology.address(HOST) in checks["bind address"]["detail"]
    rt = checks["round trip"]["data"]
    assert rt["byte_exact"] == rt["objects"]
    figures.record(
        doctor_elapsed_s=doc["elapsed_s"],
        roundtrip_put_s=rt["put_s"],
        roundtrip_get_s=rt["get_s"],
        roundtrip_bytes=rt["objects"] * rt["object_bytes"],
    )


def test_doctor_loopback_bind_with_remote_master(pd_topology, pd_cluster):
    rc, _, checks = _doctor(
        pd_topology,
        pd_cluster,
        env={"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"},
    )
    check = checks["bind address"]
    assert rc == 1
    assert check["status"] == "FAIL" and "remote" in check["detail"]


def test_inspect_across_hosts(pd_topology, pd_cluster):
    result = _run_cli(
        pd_topology,
        pd_cluster,
        "inspect",
        "--json",
        "--extra-config",
        _extra(pd_topology, pd_cluster),
        "--admin-url",
        pd_cluster.metrics_url(),
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    names = {seg["name"].rpartition(":")[0] for seg in doc["segments"]}
    assert {pd_topology.address("store1"), pd_topology.address("store2")} <= names
    assert all(seg["capacity_bytes"] == 256 << 20 for seg in doc["segments"])
    assert isinstance(doc["namespaces"], list) and doc["health"]["role"] == "leader"
