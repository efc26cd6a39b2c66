"""Prefill and decode nodes on different hosts share one Mooncake L3.

Topology (``pd_cluster``): master + HTTP metadata on ``master``, storage nodes
on ``store1``/``store2``, sglang nodes (``node_worker`` processes with real
host pools) on ``prefill``, ``prefill2`` and ``decode``, each bound to its own
address. The nodes are pure clients (``global_segment_size`` 0): every byte
crosses the bridge to a storage host and back.

One module fixture runs all the traffic at once (five processes, so sglang's
import cost overlaps):

* ``prefill`` writes requests 0-7 and ``prefill2`` writes requests 4-11 at the
  same moment (released together after both connected); every request starts
  with the same 2-key prefix, so the two hosts race on shared keys and on
  requests 4-7 entirely;
* ``decode`` reads requests 0-11 into fresh pools;
* ``decode`` writes requests 100-103 of another seed and ``prefill`` reads them
  (the reverse direction).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.netns.workers import mib_per_s, report_of, spawn_worker, touch, wait_for_files

pytestmark = [pytest.mark.netns, pytest.mark.integration]

MODEL = "pd-share/glm-5.3-flash-like"
KEYS_PER_REQUEST = 4
SHARED_PREFIX_KEYS = 2


@pytest.fixture(scope="module")
def pd_traffic(pd_topology, pd_cluster) -> dict[str, dict[str, Any]]:
    topo, log = pd_topology, pd_topology.log_dir
    forward = [
        "--model",
        MODEL,
        "--seed",
        "201",
        "--keys-per-request",
        str(KEYS_PER_REQUEST),
        "--shared-prefix-keys",
        str(SHARED_PREFIX_KEYS),
    ]
    reverse = [
        "--model",
        MODEL,
        "--seed",
        "202",
        "--keys-per-request",
        str(KEYS_PER_REQUEST),
        "--requests",
        "100-103",
    ]
    go, read_forward = log / "pd.go", log / "pd.read-forward"
    connected = {h: log / f"pd-{h}.connected" for h in ("prefill", "prefill2")}
    reverse_done = log / "pd-reverse.written"
    procs = {
        "writer_prefill": spawn_worker(
            topo,
            pd_cluster,
            "prefill",
            "pd-writer-prefill",
            "write",
            *forward,
            "--requests",
            "0-7",
            "--connected-file",
            str(connected["prefill"]),
            "--go-file",
            str(go),
        ),
        "writer_prefill2": spawn_worker(
            topo,
            pd_cluster,
            "prefill2",
            "pd-writer-prefill2",
            "write",
            *forward,
            "--requests",
            "4-11",
            "--connected-file",
            str(connected["prefill2"]),
            "--go-file",
            str(go),
        ),
        "reader_decode": spawn_worker(
            topo,
            pd_cluster,
            "decode",
            "pd-reader-decode",
            "read",
            *forward,
            "--requests",
            "0-11",
            "--wait-for",
            str(read_forward),
        ),
        "writer_decode": spawn_worker(
            topo,
            pd_cluster,
            "decode",
            "pd-writer-decode",
            "write",
            *reverse,
            "--ready-file",
            str(reverse_done),
        ),
        "reader_prefill": spawn_worker(
            topo,
            pd_cluster,
            "prefill",
            "pd-reader-prefill",
            "read",
            *reverse,
            "--wait-for",
            str(reverse_done),
        ),
    }
    writers = [procs["writer_prefill"], procs["writer_prefill2"]]
    # Release both prefill writers together once both are connected, so their puts interleave.
    wait_for_files(connected.values(), writers)
    touch(go)
    reports = {name: report_of(procs[name]) for name in ("writer_prefill", "writer_prefill2")}
    touch(read_forward)
    reports.update({name: report_of(p) for name, p in procs.items() if name not in reports})
    return reports


def _requests(report: dict[str, Any], ids: range) -> list[dict[str, Any]]:
    return [r for r in report["requests"] if r["id"] in ids]


def test_prefill_writes_decode_restores(pd_traffic, figures):
    """Requests 0-3 exist only because prefill wrote them; decode, on another host with
    fresh pools and other host pages, gets every key as a hit and restores byte-exact."""
    wrote, read = pd_traffic["writer_prefill"], pd_traffic["reader_decode"]
    assert wrote["returncode"] == 0, wrote
    assert read["returncode"] == 0, read
    assert wrote["host"] != read["host"]
    only_prefill = _requests(read, range(0, 4))
    assert [r["hit_keys"] for r in only_prefill] == [KEYS_PER_REQUEST] * 4, only_prefill
    assert [r["restored_keys"] for r in only_prefill] == [KEYS_PER_REQUEST] * 4
    assert all(r["mamba_restored"] for r in only_prefill)
    assert sum(r["mismatched_pages"] for r in only_prefill) == 0
    assert read["exceptions"] == [] and wrote["exceptions"] == []
    assert read["layout_guard"] == "matched"
    figures.record(
        writer=wrote["host"],
        reader=read["host"],
        keys_written=wrote["written_keys"],
        tokens_written=wrote["written_keys"] * 256,
        bytes_written=wrote["bytes_written"],
        write_io_s=wrote["times"]["write_io_s"],
        write_mib_s=mib_per_s(wrote["bytes_written"], wrote["times"]["write_io_s"]),
        reader_keys=read["keys"],
        reader_hits=read["hit_keys"],
        reader_restored=read["restored_keys"],
        bytes_read=read["bytes_read"],
        read_io_s=read["times"]["read_io_s"],
        read_mib_s=mib_per_s(read["bytes_read"], read["times"]["read_io_s"]),
        mismatched_pages=read["mismatched_pages"],
        worker_import_s=wrote["times"]["import_s"],
    )


def test_decode_writes_prefill_restores(pd_traffic, figures):
    """The reverse direction: decode backs up, prefill (another host) restores byte-exact."""
    wrote, read = pd_traffic["writer_decode"], pd_traffic["reader_prefill"]
    assert wrote["returncode"] == 0, wrote
    assert wrote["written_keys"] == wrote["keys"] == 16
    assert read["returncode"] == 0, read
    assert (read["hit_keys"], read["restored_keys"], read["mamba_restored"]) == (16, 16, 4), read[
        "requests"
    ]
    assert read["mismatched_pages"] == 0
    assert read["exceptions"] == [] and wrote["exceptions"] == []
    figures.record(
        writer=wrote["host"],
        reader=read["host"],
        keys=wrote["keys"],
        bytes=wrote["bytes_written"],
        hits=read["hit_keys"],
        restored=read["restored_keys"],
        mismatched_pages=read["mismatched_pages"],
        write_io_s=wrote["times"]["write_io_s"],
        read_io_s=read["times"]["read_io_s"],
    )


def test_two_prefill_nodes_overlapping_prefixes(pd_traffic, figures):
    """Two prefill hosts write at the same moment, sharing a prefix on every request and
    requests 4-7 entirely. Overlapping keys count as success (first writer's bytes stay,
    and they are the same bytes); decode verifies all 12 requests."""
    a, b = pd_traffic["writer_prefill"], pd_traffic["writer_prefill2"]
    read = pd_traffic["reader_decode"]
    for report in (a, b):
        assert report["returncode"] == 0, report
        assert report["written_keys"] == report["keys"] == 32, report["requests"]
        assert report["exceptions"] == []
    (a_start, a_end), (b_start, b_end) = a["write_window"], b["write_window"]
    overlap_s = min(a_end, b_end) - max(a_start, b_start)
    assert read["returncode"] == 0, read
    assert (read["hit_keys"], read["restored_keys"], read["mamba_restored"]) == (48, 48, 12), read[
        "requests"
    ]
    assert read["mismatched_pages"] == 0
    figures.record(
        writer_keys={a["host"]: a["written_keys"], b["host"]: b["written_keys"]},
        write_io_s={a["host"]: a["times"]["write_io_s"], b["host"]: b["times"]["write_io_s"]},
        concurrent_write_overlap_s=round(overlap_s, 4),
        # one 2-key prefix shared by all 12 requests + 2 own keys each
        distinct_keys=SHARED_PREFIX_KEYS + 12 * (KEYS_PER_REQUEST - SHARED_PREFIX_KEYS),
        reader_keys=read["keys"],
        reader_hits=read["hit_keys"],
        reader_restored=read["restored_keys"],
        mismatched_pages=read["mismatched_pages"],
    )
    assert overlap_s > 0, (
        f"the two writers did not write at the same time: {a['write_window']} {b['write_window']}"
    )
