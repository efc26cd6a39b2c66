"""Cluster-wide layout guard: a node whose span geometry conflicts is refused at start-up.

The publisher (``prefill``) starts two nodes of model ``guard/...``: one with
the ``store`` guard (record kept as a Mooncake object) and one with the
``etcd`` guard (record in etcd on the master host, ``span_layout_guard_etcd``).
The prober (``decode``, another host) then starts, one after the other,
nodes with a different layer count, a different ``storage_page_size``, and the
same geometry, under each guard. Conflicting nodes fail with
LayoutConflictError naming both sides; the matching node starts.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.netns.workers import report_of, spawn_worker

pytestmark = [pytest.mark.netns, pytest.mark.integration]

GUARDS = ("store", "etcd")
CONFLICTS = {"layers": "layers=3", "storage_page_size": "storage_page_tokens=512"}


@pytest.fixture(scope="module")
def guard_runs(pd_topology, pd_cluster) -> dict[str, Any]:
    topo, log = pd_topology, pd_topology.log_dir
    published = log / "guard.published"
    common = [
        "--model",
        "guard/glm-5.3-flash-like",
        "--layout-guard-etcd",
        str(pd_cluster.etcd_endpoint),
    ]
    publisher = spawn_worker(
        topo,
        pd_cluster,
        "prefill",
        "guard-publisher",
        "probe",
        *common,
        *(arg for guard in GUARDS for arg in ("--variant", f"layout_guard={guard}")),
        "--ready-file",
        str(published),
    )
    variants = [
        f"layout_guard={guard},{change}" if change else f"layout_guard={guard}"
        for guard in GUARDS
        for change in (*CONFLICTS.values(), "")
    ]
    prober = spawn_worker(
        topo,
        pd_cluster,
        "decode",
        "guard-prober",
        "probe",
        *common,
        *(arg for variant in variants for arg in ("--variant", variant)),
        "--wait-for",
        str(published),
    )
    return {"publisher": report_of(publisher), "prober": report_of(prober)}


@pytest.mark.parametrize("guard", GUARDS)
def test_layout_guard_refuses_conflicting_geometry(guard_runs, guard, figures):
    publisher = guard_runs["publisher"]
    assert publisher["returncode"] == 0, publisher
    mine = {n["layout_guard_mode"]: n for n in publisher["nodes"]}[guard]
    assert mine["refused"] is False and mine["layout_guard"] == "published", mine

    prober = guard_runs["prober"]
    assert prober["returncode"] == 3, prober  # some node was refused
    nodes = {n["variant"]: n for n in prober["nodes"] if n["layout_guard_mode"] == guard}
    layers = nodes[f"layout_guard={guard},{CONFLICTS['layers']}"]
    page = nodes[f"layout_guard={guard},{CONFLICTS['storage_page_size']}"]
    same = nodes[f"layout_guard={guard}"]
    figures.record(
        **{
            guard: {
                "publisher": {"host": publisher["host"], "result": mine["layout_guard"]},
                "prober_host": prober["host"],
                "different_layers": {"refused": layers["refused"], "error": layers["error"]},
                "different_storage_page_size": {"refused": page["refused"], "error": page["error"]},
                "same_geometry": {"refused": same["refused"], "result": same.get("layout_guard")},
            }
        }
    )
    # a different layer count changes the bytes of every KV/indexer page
    assert layers["refused"] is True, layers
    assert "LayoutConflict" in layers["error"] or "conflicts" in layers["error"]
    assert "pool kv" in layers["error"] and "vs published" in layers["error"], layers["error"]
    # a different storage page (K=8 instead of 4) for the same model name
    assert page["refused"] is True, page
    assert "storage_page_tokens: this node 512 vs published 256" in page["error"], page["error"]
    # the matching node starts
    assert same["refused"] is False and same["layout_guard"] == "matched", same
