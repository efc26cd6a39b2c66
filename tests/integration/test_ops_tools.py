"""`mooncake-span doctor` and `inspect` against a real cluster, healthy and broken.

The commands run as the operator runs them (``python -m mooncake_span.ops.cli``
in a child process), so exit codes, the 20 s bound and the native-log file are
what is tested.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake_span.span.keys import ComponentSpec, KeySchema, RankScope, RankTags
from mooncake_span.store.layout_guard import GeometryRecord, PoolGeometry, namespace_key
from tests import checkout

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DOCTOR_BOUND_S = 20.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cli(*argv: str, env: dict[str, str] | None = None, timeout_s: float = 60.0):
    full_env = {**os.environ, "PYTHONPATH": checkout.PYTHONPATH, **(env or {})}
    for name in ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME"):
        full_env.pop(name, None)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mooncake_span.ops.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=full_env,
        cwd=REPO,
    )
    return result, time.monotonic() - started


def inspect_json(cluster, *extra: str) -> dict:
    """``mooncake-span inspect --json`` against ``cluster``; the parsed document."""
    result, _ = _cli(
        "inspect",
        "--json",
        "--master",
        cluster.master_address,
        "--metadata",
        cluster.metadata_server,
        "--admin-url",
        cluster.metrics_url,
        *extra,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _doctor(cluster, *extra: str, env=None):
    argv = ["doctor", "--json", "--admin-url", cluster.metrics_url, *extra]
    if "--master" not in extra:
        argv += ["--master", cluster.master_address]
    if "--metadata" not in extra:
        argv += ["--metadata", cluster.metadata_server]
    result, elapsed_s = _cli(*argv, env=env, timeout_s=DOCTOR_BOUND_S + 15)
    doc = json.loads(result.stdout)
    doc["_stderr"] = result.stderr
    return result.returncode, doc, {c["name"]: c for c in doc["checks"]}, elapsed_s


def _status(checks, name):
    return checks[name]["status"]


def test_doctor_passes_on_a_healthy_cluster(mooncake_cluster, tmp_path):
    log = tmp_path / "native.log"
    rc, doc, checks, elapsed_s = _doctor(
        mooncake_cluster, "--model", "doctor-model", "--native-log", str(log)
    )
    assert rc == 0 and doc["ok"], doc
    for name in ("config", "master", "master admin", "metadata", "bind address", "round trip"):
        assert _status(checks, name) == "PASS", checks[name]
    rt = checks["round trip"]["data"]
    assert rt["byte_exact"] == rt["objects"] == rt["removed"] == 4
    assert rt["put_s"] > 0 and rt["get_s"] > 0
    assert _status(checks, "layout guard") == "PASS"
    assert "no record yet" in checks["layout guard"]["detail"]
    # The native client's log went to the file, not to the operator's terminal.
    assert doc["native_log"] == str(log) and log.stat().st_size > 0
    assert ".cpp:" not in doc["_stderr"] and ".cpp:" in log.read_text()
    assert elapsed_s < DOCTOR_BOUND_S


def test_doctor_dead_master_fails_fast(mooncake_cluster):
    dead = f"127.0.0.1:{_free_port()}"
    rc, doc, checks, elapsed_s = _doctor(mooncake_cluster, "--master", dead)
    assert rc == 1 and not doc["ok"]
    assert _status(checks, "master") == "FAIL" and dead in checks["master"]["detail"]
    assert checks["master"]["fix"]
    assert _status(checks, "round trip") == "FAIL"
    assert "master failed" in checks["round trip"]["detail"]
    assert elapsed_s < DOCTOR_BOUND_S


def test_doctor_dead_etcd_fails_fast(mooncake_cluster):
    dead = f"etcd://127.0.0.1:{_free_port()}"
    rc, doc, checks, elapsed_s = _doctor(mooncake_cluster, "--metadata", dead)
    assert rc == 1
    assert _status(checks, "etcd") == "FAIL" and "does not answer" in checks["etcd"]["detail"]
    assert _status(checks, "round trip") == "FAIL"
    # Mooncake's own setup would block for minutes here.
    assert elapsed_s < DOCTOR_BOUND_S


def test_doctor_wrong_metadata_url(mooncake_cluster):
    # The master's admin server is HTTP but not a metadata server.
    wrong = mooncake_cluster.metrics_url + "/metadata"
    rc, doc, checks, elapsed_s = _doctor(mooncake_cluster, "--metadata", wrong)
    assert rc == 1
    assert _status(checks, "metadata") == "FAIL"
    assert "not a Mooncake metadata server" in checks["metadata"]["detail"]
    closed = f"http://127.0.0.1:{_free_port()}/metadata"
    rc, doc, checks, elapsed_s = _doctor(mooncake_cluster, "--metadata", closed)
    assert rc == 1 and "unreachable" in checks["metadata"]["detail"]
    assert elapsed_s < DOCTOR_BOUND_S


def test_doctor_bind_address_mismatch(mooncake_cluster):
    extra = json.dumps(
        {
            "master_server_address": mooncake_cluster.master_address,
            "metadata_server": mooncake_cluster.metadata_server,
            "protocol": "tcp",
            "local_hostname": "127.0.0.2",
            "global_segment_size": 0,
        }
    )
    rc, doc, checks, _ = _doctor(
        mooncake_cluster, "--extra-config", extra, env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    )
    assert rc == 1
    check = checks["bind address"]
    assert check["status"] == "FAIL"
    assert "127.0.0.2" in check["detail"] and "127.0.0.1" in check["detail"]
    assert checks["config"]["data"]["settings"]["source"].startswith("extra_config")


def test_doctor_text_output_one_line_per_check(mooncake_cluster):
    result, _ = _cli(
        "doctor",
        "--master",
        f"127.0.0.1:{_free_port()}",
        "--metadata",
        mooncake_cluster.metadata_server,
        timeout_s=DOCTOR_BOUND_S + 15,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 1
    assert lines[0].startswith("PASS  config")
    assert any(line.startswith("FAIL  master") for line in lines)
    assert any(line.strip().startswith("fix: ") for line in lines)
    assert lines[-1].startswith("doctor: ") and "FAILED" in lines[-1]


# ---- inspect -----------------------------------------------------------------------


def _schema(model: str, pages_per_span: int, tag: str | None = None) -> KeySchema:
    return KeySchema(
        model=model,
        host_page_tokens=64,
        pages_per_span=pages_per_span,
        layout="page_first",
        kv_dtype="bfloat16",
        ranks=RankTags.from_ranks(tp_rank=0),
        tag=tag,
    )


def test_inspect_reports_namespaces_objects_bytes_and_guard(
    mooncake_cluster, mooncake_store_factory, key_namespace
):
    store = mooncake_store_factory()
    model_a, model_b = f"{key_namespace}-a", f"{key_namespace}-b"
    a, b = _schema(model_a, 4), _schema(model_b, 2, tag="blue")
    comps = (
        ComponentSpec("k", RankScope.REPLICATED),
        ComponentSpec("indexer", RankScope.REPLICATED),
    )
    a_keys = a.object_keys([f"{i:064x}" for i in range(6)], comps)  # 6 storage keys x 2
    b_keys = b.object_keys([f"{i:064x}" for i in range(3)], comps[:1])
    record = GeometryRecord(
        host_page_tokens=64,
        storage_page_tokens=256,
        layout="page_first",
        kv_dtype="bfloat16",
        pools={
            "kv": PoolGeometry(("k",), (1000,), 64),
            "indexer": PoolGeometry(("indexer",), (24,), 64),
        },
    )
    guard_key = namespace_key(model_a, None)
    written = [*a_keys, *b_keys, guard_key]
    try:
        for key in a_keys:
            assert store.put(key, b"x" * (4000 if key.endswith("_k") else 96)) == 0
        for key in b_keys:
            assert store.put(key, b"y" * 2000) == 0
        assert store.put(guard_key, record.to_json().encode()) == 0
        doc = inspect_json(mooncake_cluster, "--exact-bytes")
    finally:
        for key in written:
            store.remove(key, True)
    by_name = {ns["name"]: ns for ns in doc["namespaces"]}
    ns_a, ns_b = by_name[a.prefix], by_name[b.prefix]
    assert (ns_a["objects"], ns_a["storage_keys"], ns_a["pages_per_span"]) == (12, 6, 4)
    assert ns_a["bytes"] == 6 * 4000 + 6 * 96 and not ns_a["bytes_estimated"]
    assert ns_a["components"] == {"__indexer": 6, "__k": 6}
    assert (ns_b["objects"], ns_b["tag"], ns_b["pages_per_span"]) == (3, "blue", 2)
    assert ns_b["bytes"] == 3 * 2000
    assert ns_a["layout_guard"]["key"] == guard_key and ns_a["layout_guard"]["record"]
    assert not ns_b["layout_guard"]["found"]
    layout = ns_a["object_layout"]
    pools = {p["pool"]: p for p in layout["hicache_object_layout"]["pools"]}
    assert pools["kv"]["bytes_per_key"] == 4000 and pools["kv"]["suffixes"] == ["__k"]
    assert layout["span"]["bytes_per_key"] == 4000 + 96
    assert guard_key in doc["layout_guard_records"]
    assert doc["segments"] and all(s["capacity_bytes"] > 0 for s in doc["segments"])
    assert doc["keys"]["mode"] == "streamed" and doc["keys"]["total"] >= len(written)


def test_inspect_samples_bytes_by_default(mooncake_cluster, mooncake_store_factory, key_namespace):
    store = mooncake_store_factory()
    schema = _schema(key_namespace, 4)
    keys = schema.object_keys(
        [f"{i:064x}" for i in range(40)], (ComponentSpec("k", RankScope.REPLICATED),)
    )
    try:
        for key in keys:
            assert store.put(key, b"z" * 512) == 0
        result, _ = _cli(
            "inspect",
            "--json",
            "--sample",
            "5",
            "--no-records",
            "--admin-url",
            mooncake_cluster.metrics_url,
            "--master",
            mooncake_cluster.master_address,
        )
        doc = json.loads(result.stdout)
    finally:
        for key in keys:
            store.remove(key, True)
    ns = {n["name"]: n for n in doc["namespaces"]}[schema.prefix]
    assert ns["objects"] == 40 and ns["sampled_objects"] == 5
    assert ns["bytes_estimated"] and ns["bytes"] == 40 * 512  # every object has the same size
    assert doc["bytes_mode"] == "sampled (5 per namespace)"


def test_inspect_dead_admin_server_is_a_clear_error():
    result, _ = _cli(
        "inspect", "--admin-url", f"http://127.0.0.1:{_free_port()}", "--master", "127.0.0.1:1"
    )
    assert result.returncode == 1
    assert "admin server" in result.stderr


def test_doctor_with_ha_masters_behind_etcd(tmp_path):
    """etcd:// master and metadata: etcd checked, a real round trip, and no wait on
    the native client's 14-32 s close in that mode."""
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=128 << 20,
        etcd=True,
        ha_masters=2,
        log_dir=tmp_path / "ha",
    )
    with LocalCluster(spec) as cluster:
        assert cluster.master_address.startswith("etcd://")
        rc, doc, checks, elapsed_s = _doctor(cluster)
    assert rc == 0, [c for c in doc["checks"] if c["status"] not in ("PASS", "SKIP")]
    assert _status(checks, "master") == "SKIP" and _status(checks, "etcd") == "PASS"
    assert _status(checks, "master admin") == "PASS"
    assert checks["master admin"]["data"]["health"]["role"] == "leader"
    assert _status(checks, "round trip") == "PASS"
    assert elapsed_s < DOCTOR_BOUND_S
