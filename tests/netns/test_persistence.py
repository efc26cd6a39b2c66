"""Restart persistence: where the cache lives decides whether it outlives the server.

Persistent deployment (``pd_cluster``): the sglang nodes are pure clients
(``global_segment_size`` 0) and the bytes live on dedicated storage nodes
(``store1``/``store2``). A writer that exits cleanly, and one that is
SIGKILLed like a crashed server, leave everything behind: a NEW process with
the same config (another host, fresh pools) gets the same hits and restores
byte-exact. The reader is started early only so that sglang's import overlaps
the writers; it creates its Mooncake client after both writers are gone.

Non-persistent deployment (a second master on the ``master`` host, no storage
nodes): the serving process contributes the memory itself
(``global_segment_size`` > 0). While it runs, another host restores its
cache; once it exits, its segment is unmounted with it and the same reader
finds nothing (0 hits) -- and restores nothing wrong.
"""

from __future__ import annotations

import re
import signal
from typing import Any

import pytest

from mooncake_span_tools.lab.netns import NetnsCluster, NetnsClusterSpec
from tests.netns.workers import report_of, spawn_worker, touch, wait_for_files

pytestmark = [pytest.mark.netns, pytest.mark.integration]

_SERVING_SEGMENT_BYTES = 64 << 20


def _mem_used(summary: str | None) -> str | None:
    match = re.search(r"Mem Storage: ([^|]+?) \|", summary or "")
    return match.group(1) if match else None


@pytest.fixture(scope="module")
def restart_runs(pd_topology, pd_cluster) -> dict[str, Any]:
    topo, log = pd_topology, pd_topology.log_dir
    np_cluster = NetnsCluster(
        topo,
        NetnsClusterSpec(master_hosts=("master",), storage_hosts=(), port_offset=100),
        name="np",
    )
    with np_cluster:
        persistent = [
            "--model",
            "restart/glm-5.3-flash-like",
            "--seed",
            "301",
            "--keys-per-request",
            "4",
        ]
        serving = [
            "--model",
            "serving-segment/glm-5.3-flash-like",
            "--seed",
            "302",
            "--keys-per-request",
            "4",
            "--requests",
            "0-3",
        ]
        writers_gone, np_written, np_first_read, np_release, np_gone = (
            log / "restart.writers-gone",
            log / "np.written",
            log / "np.first-read",
            log / "np.release",
            log / "np.gone",
        )
        procs = {
            "clean": spawn_worker(
                topo,
                pd_cluster,
                "prefill",
                "restart-writer-clean",
                "write",
                *persistent,
                "--requests",
                "0-3",
                "--exit",
                "close",
            ),
            "killed": spawn_worker(
                topo,
                pd_cluster,
                "prefill2",
                "restart-writer-killed",
                "write",
                *persistent,
                "--requests",
                "10-13",
                "--exit",
                "sigkill",
            ),
            "new_reader": spawn_worker(
                topo,
                pd_cluster,
                "decode",
                "restart-reader",
                "read",
                *persistent,
                "--requests",
                "0-3,10-13",
                "--wait-for",
                str(writers_gone),
            ),
            "np_writer": spawn_worker(
                topo,
                np_cluster,
                "prefill",
                "np-writer",
                "write",
                *serving,
                "--ready-file",
                str(np_written),
                "--hold-file",
                str(np_release),
                "--exit",
                "close",
                segment_bytes=_SERVING_SEGMENT_BYTES,
            ),
            "np_reader": spawn_worker(
                topo,
                np_cluster,
                "decode",
                "np-reader",
                "read",
                *serving,
                "--wait-for",
                str(np_written),
                "--ready-file",
                str(np_first_read),
                "--again-after",
                str(np_gone),
            ),
        }
        runs: dict[str, Any] = {}
        runs["clean"] = report_of(procs["clean"])
        runs["killed"] = report_of(procs["killed"])
        runs["summary_after_writers"] = _mem_used(pd_cluster.summary())
        touch(writers_gone)
        runs["new_reader"] = report_of(procs["new_reader"])

        # The serving-segment writer holds until the other host has read once.
        wait_for_files([np_first_read], [procs["np_reader"]])
        runs["np_summary_while_serving"] = _mem_used(np_cluster.summary())
        touch(np_release)
        runs["np_writer"] = report_of(procs["np_writer"])
        runs["np_summary_after_exit"] = _mem_used(np_cluster.summary())
        touch(np_gone)
        runs["np_reader"] = report_of(procs["np_reader"])
    return runs


def test_restart_persistence(restart_runs, figures):
    clean, killed, reader = (
        restart_runs["clean"],
        restart_runs["killed"],
        restart_runs["new_reader"],
    )
    assert clean["returncode"] == 0, clean
    assert killed["returncode"] == -signal.SIGKILL, killed
    for writer in (clean, killed):
        assert writer["segment_bytes"] == 0  # the bytes cannot live in the writer
        assert writer["written_keys"] == writer["keys"] == 16, writer["requests"]
    assert reader["returncode"] == 0, reader
    assert reader["pid"] not in (clean["pid"], killed["pid"])
    by_request = {r["id"]: r for r in reader["requests"]}
    figures.record(
        writer_clean_exit={
            "keys": clean["written_keys"],
            "bytes": clean["bytes_written"],
            "exit": clean["returncode"],
        },
        writer_sigkill={
            "keys": killed["written_keys"],
            "bytes": killed["bytes_written"],
            "exit": killed["returncode"],
        },
        storage_nodes_mem_used=restart_runs["summary_after_writers"],
        new_process_hits={
            "after_clean_exit": sum(by_request[i]["hit_keys"] for i in range(0, 4)),
            "after_sigkill": sum(by_request[i]["hit_keys"] for i in range(10, 14)),
        },
        new_process_restored=reader["restored_keys"],
        mismatched_pages=reader["mismatched_pages"],
        read_io_s=reader["times"]["read_io_s"],
    )
    assert reader["hit_keys"] == reader["restored_keys"] == 32, reader["requests"]
    assert reader["mamba_restored"] == 8
    assert reader["mismatched_pages"] == 0


def test_segment_in_serving_process_is_not_persistent(restart_runs, figures):
    writer, reader = restart_runs["np_writer"], restart_runs["np_reader"]
    assert writer["returncode"] == 0, writer
    assert writer["segment_bytes"] == _SERVING_SEGMENT_BYTES
    assert writer["written_keys"] == 16
    while_serving, after_exit = reader, reader["again"]
    figures.record(
        serving_segment_bytes=writer["segment_bytes"],
        keys_written=writer["written_keys"],
        hits_while_writer_runs=while_serving["hit_keys"],
        restored_while_writer_runs=while_serving["restored_keys"],
        mem_used_while_serving=restart_runs["np_summary_while_serving"],
        mem_used_after_exit=restart_runs["np_summary_after_exit"],
        hits_after_writer_exit=after_exit["hit_keys"],
        restored_after_writer_exit=after_exit["restored_keys"],
        mismatched_pages=while_serving["mismatched_pages"] + after_exit["mismatched_pages"],
    )
    # It works while the serving process lives...
    assert (while_serving["hit_keys"], while_serving["restored_keys"]) == (16, 16), while_serving[
        "requests"
    ]
    assert while_serving["mismatched_pages"] == 0
    # ...and is gone with it: no hits, nothing restored, nothing corrupt.
    assert reader["returncode"] == 0, reader
    assert after_exit["hit_keys"] == 0, after_exit["requests"]
    assert after_exit["restored_keys"] == 0
    assert after_exit["mismatched_pages"] == 0
