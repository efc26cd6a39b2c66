"""Fixtures for the multi-host tests: namespaces, a shared Mooncake deployment, figures.

Tests marked ``netns`` create network namespaces (root + iproute2). Where
that is impossible they are skipped, except when ``CI`` is set: there they
fail with the reason, because CI must never pass by skipping.

``pd_cluster`` is one topology for the session (hosts master, store1,
store2, prefill, prefill2, decode) with a master (embedded HTTP metadata),
two storage nodes and an etcd on the master host for the layout guard. Tests
keep their objects apart by using their own model name. The HA tests build
topologies of their own, because they kill masters.

``figures`` records what a test measured: printed at once (``pytest -s``
shows it; otherwise it is in the captured output of a failing test) and
written to ``<tmp_path>/figures.json``. With ``MOONCAKE_SPAN_FIGURES_DIR``
set, a copy also goes to ``$MOONCAKE_SPAN_FIGURES_DIR/<test>.json``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_span_tools.lab.netns import (
    NetnsCluster,
    NetnsClusterSpec,
    NetnsTopology,
    TopologySpec,
)
from tests.conftest import require_mooncake, require_netns

PD_HOSTS = ("master", "store1", "store2", "prefill", "prefill2", "decode")
_FIGURES_ENV = "MOONCAKE_SPAN_FIGURES_DIR"


@pytest.fixture(autouse=True)
def _require_netns_for_marked(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("netns") is not None:
        require_netns()


def assert_torn_down(topology: NetnsTopology) -> None:
    """No namespace of this run and none of its processes may survive teardown."""
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    ours = [line.split()[0] for line in listed.splitlines() if line.startswith(topology.spec.tag)]
    assert not ours, f"namespaces left behind: {ours}"
    alive = [p.name for p in topology.processes() if p.running()]
    assert not alive, f"processes left behind: {alive}"


@pytest.fixture(scope="session")
def pd_topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsTopology]:
    # Session fixtures run before the per-test skip checks: check here too.
    require_netns()
    require_mooncake()
    topology = NetnsTopology(
        TopologySpec(hosts=PD_HOSTS), log_dir=tmp_path_factory.mktemp("netns-pd")
    )
    with topology:
        yield topology
    assert_torn_down(topology)


@pytest.fixture(scope="session")
def pd_cluster(pd_topology: NetnsTopology) -> Iterator[NetnsCluster]:
    spec = NetnsClusterSpec(
        master_hosts=("master",),
        storage_hosts=("store1", "store2"),
        etcd_host="master",
        segment_bytes=256 << 20,
    )
    with NetnsCluster(pd_topology, spec, name="pd") as cluster:
        yield cluster


class Figures:
    """What one test measured; see the module docstring."""

    def __init__(self, test_name: str, path: Path) -> None:
        self.test_name = test_name
        self.path = path
        self.data: dict[str, Any] = {}

    def record(self, **values: Any) -> None:
        self.data.update(values)
        print(f"[figures] {self.test_name}: {json.dumps(values, sort_keys=True)}", flush=True)
        self._save()

    def _save(self) -> None:
        text = json.dumps({"test": self.test_name, **self.data}, indent=2, sort_keys=True)
        self.path.write_text(text)
        directory = os.environ.get(_FIGURES_ENV)
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            safe = re.sub(r"[^A-Za-z0-9_.\-]+", "_", self.test_name)
            (Path(directory) / f"{safe}.json").write_text(text)


@pytest.fixture
def figures(request: pytest.FixtureRequest, tmp_path: Path) -> Figures:
    return Figures(request.node.name, tmp_path / "figures.json")
