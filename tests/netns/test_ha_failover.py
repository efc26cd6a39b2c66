"""HA masters with etcd: kill the leader while a node is busy, measure, check the data.

Each variant has its own topology: etcd and master A on ``master``, master B
on ``master2``, storage nodes on ``store1``/``store2``, a node on ``prefill``
and, for the oplog variant, a fresh node on ``decode``. Masters run with
``--enable_ha`` (and ``--enable_oplog=true`` in one variant); every client
uses ``etcd://`` for both the master and the metadata, so no client names a
master. The node also uses the etcd layout guard.

The node (``node_worker failover``) writes 4 requests, then keeps doing what a
busy sglang node does -- hit query and restore of request 0, backup of a new
request -- in rounds, while the test SIGKILLs the leading master. It records
every call's duration, and when backups work again. Requirements:

* during the election backend calls fail cleanly (per-key False, empty hit),
  raise nothing and none blocks beyond ``CALL_BOUND_S``;
* calls resume by themselves;
* with the oplog, the keys written before the failover are restorable
  byte-exact (by the same node and by a brand-new one); without it the new
  leader starts empty: 0 hits, and nothing restored is wrong.

Both variants run at the same time to overlap their ~10 s elections.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mooncake_span_tools.lab.netns import (
    NetnsCluster,
    NetnsClusterSpec,
    NetnsTopology,
    TopologySpec,
)
from tests.conftest import require_mooncake
from tests.netns.conftest import assert_torn_down, require_netns
from tests.netns.workers import WORKER_TIMEOUT_S, report_of, spawn_worker, touch, wait_for_files

pytestmark = [pytest.mark.netns, pytest.mark.integration]

HA_HOSTS = ("master", "master2", "store1", "store2", "prefill", "decode")
# One backend call may make two native calls (exists, then put/get); with the
# master gone each native call takes ~4.3 s before -900 RPC_FAIL.
CALL_BOUND_S = 12.0
RESUME_BOUND_S = 45.0


def _run_variant(oplog: bool, log_dir: Path) -> dict[str, Any]:
    topology = NetnsTopology(TopologySpec(hosts=HA_HOSTS), log_dir=log_dir)
    result: dict[str, Any] = {"oplog": oplog}
    with topology:
        spec = NetnsClusterSpec(
            master_hosts=("master", "master2"),
            storage_hosts=("store1", "store2"),
            etcd_host="master",
            enable_oplog=oplog,
            segment_bytes=128 << 20,
        )
        with NetnsCluster(topology, spec, name="ha") as cluster:
            result["first_leader"] = cluster.wait_for_leader(30.0)
            ready, kill, reader_go = (
                log_dir / "ha.ready",
                log_dir / "ha.kill",
                log_dir / "ha.reader-go",
            )
            common = [
                "--model",
                f"ha-{'oplog' if oplog else 'nooplog'}/glm-5.3-flash-like",
                "--seed",
                "401",
                "--requests",
                "0-3",
                "--keys-per-request",
                "4",
                "--layout-guard",
                "etcd",
                "--layout-guard-etcd",
                str(cluster.etcd_endpoint),
                # A client of etcd:// masters waits up to 30 s in close(); skip it.
                "--exit",
                "fast",
            ]
            traffic = spawn_worker(
                topology,
                cluster,
                "prefill",
                "ha-traffic",
                "failover",
                *common,
                "--ready-file",
                str(ready),
                "--kill-marker",
                str(kill),
                "--settle-s",
                "4",
            )
            reader = (
                spawn_worker(
                    topology,
                    cluster,
                    "decode",
                    "ha-reader",
                    "read",
                    *common,
                    "--wait-for",
                    str(reader_go),
                )
                if oplog
                else None
            )
            wait_for_files([ready], [traffic], timeout_s=WORKER_TIMEOUT_S)
            leader = cluster.leader_index()
            kill_wall = time.time()
            cluster.kill_master(leader)
            touch(kill, repr(kill_wall))
            result["killed_master"] = leader
            result["new_leader"] = cluster.wait_for_leader(60.0)
            result["election_s"] = round(time.time() - kill_wall, 2)
            result["traffic"] = report_of(traffic)
            if reader is not None:
                touch(reader_go)
                result["fresh_reader"] = report_of(reader)
    assert_torn_down(topology)
    return result


@pytest.fixture(scope="module")
def failovers(tmp_path_factory) -> dict[bool, dict[str, Any]]:
    require_netns()
    require_mooncake()
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ha-variant") as pool:
        futures = {
            oplog: pool.submit(
                _run_variant,
                oplog,
                tmp_path_factory.mktemp(f"netns-ha-{'oplog' if oplog else 'nooplog'}"),
            )
            for oplog in (True, False)
        }
        return {oplog: future.result() for oplog, future in futures.items()}


def _check_outage_and_resume(run: dict[str, Any]) -> dict[str, Any]:
    traffic = run["traffic"]
    assert traffic["returncode"] == 0, {k: v for k, v in traffic.items() if k != "failover"}
    fo = traffic["failover"]
    assert run["new_leader"] != run["killed_master"]
    # the backend answered misses during the election: no exception, no call beyond the bound
    assert traffic["exceptions"] == [], traffic["exceptions"]
    assert fo["first_failure_s"] is not None, f"no call failed after the kill: {fo['trace']}"
    assert fo["max_call_after_kill_s"] <= CALL_BOUND_S, fo
    assert fo["resume_s"] is not None and fo["resume_s"] <= RESUME_BOUND_S, fo
    # backups written after the resume read back byte-exact
    assert fo["new_after"]["restored_keys"] == fo["new_after"]["keys"] > 0, fo["new_after"]
    assert fo["new_after"]["mismatched_pages"] == 0
    assert traffic.get("round_mismatches", 0) == 0
    return fo


def _figures(run: dict[str, Any]) -> dict[str, Any]:
    traffic = run["traffic"]
    fo = traffic["failover"]
    return {
        "keys_before_failover": traffic["written_keys"],
        "bytes_before_failover": traffic["bytes_written"],
        "election_s": run["election_s"],
        "first_failure_s": fo["first_failure_s"],
        "time_to_resume_s": fo["resume_s"],
        "old_keys_visible_s": fo["old_visible_s"],
        "outage_rounds": fo["outage_rounds"],
        "calls_after_kill": fo["calls_after_kill"],
        "max_call_after_kill_s": fo["max_call_after_kill_s"],
        "slowest_call_s": traffic["slowest_call_s"],
        "exceptions": len(traffic["exceptions"]),
        "breaker_times_opened": traffic["stats"]["breaker_times_opened"],
        "error_counts": traffic["stats"]["error_counts"],
        "old_hits_after": fo["old_after"]["hit_keys"],
        "old_restored_after": fo["old_after"]["restored_keys"],
        "old_mismatched_after": fo["old_after"]["mismatched_pages"],
        "new_keys_verified_after": fo["new_after"]["restored_keys"],
        "trace": [(t["t_s"], t["round_s"], t["set_ok"], t["old_hit"]) for t in fo["trace"][:40]],
    }


def test_failover_with_oplog_keeps_the_cache(failovers, figures):
    run = failovers[True]
    fo = _check_outage_and_resume(run)
    reader = run["fresh_reader"]
    figures.record(
        **_figures(run),
        fresh_reader={
            "hits": reader["hit_keys"],
            "restored": reader["restored_keys"],
            "mismatched_pages": reader["mismatched_pages"],
            "layout_guard": reader["layout_guard"],
        },
    )
    old = fo["old_after"]
    assert (old["hit_keys"], old["restored_keys"], old["mismatched_pages"]) == (16, 16, 0), old
    assert fo["old_visible_s"] is not None
    assert reader["returncode"] == 0, reader
    assert (reader["hit_keys"], reader["restored_keys"], reader["mismatched_pages"]) == (
        16,
        16,
        0,
    ), reader["requests"]
    assert reader["layout_guard"] == "matched"


def test_failover_without_oplog_loses_the_cache_cleanly(failovers, figures):
    run = failovers[False]
    fo = _check_outage_and_resume(run)
    figures.record(**_figures(run))
    old = fo["old_after"]
    assert old["hit_keys"] == 0, f"a new leader without oplog cannot know old keys: {old}"
    assert old["restored_keys"] == 0
    assert old["mismatched_pages"] == 0
