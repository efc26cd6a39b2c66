"""The inner run of ``test_killed_run.py``: a run that holds children and waits to be killed.

Not collected by the suite (no ``test_`` prefix); the outer test runs it with
its own ``pytest`` and ``-k cluster`` or ``-k namespace``. Each case starts
what a real test starts, writes their PIDs (and namespaces) to the file named
by ``KILLED_RUN_FILE_ENV``, then waits, bounded, for the outer test's signal.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mooncake_span.ops import launcher as L

KILLED_RUN_FILE_ENV = "MOONCAKE_SPAN_KILLED_RUN_FILE"
HOLD_S = 240.0
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _report(pids: dict[str, int], **fields: object) -> None:
    path = Path(os.environ[KILLED_RUN_FILE_ENV])
    tmp = path.with_suffix(".tmp")
    run_pid = os.getpid()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # This test runs in an xdist worker: the run the outer test signals is
        # the worker's parent, the controller, and the worker must die too.
        run_pid = os.getppid()
        pids = {**pids, "xdist-worker": os.getpid()}
    tmp.write_text(json.dumps({"pytest_pid": run_pid, "pids": pids, **fields}))
    tmp.replace(path)
    time.sleep(HOLD_S)
    pytest.fail(f"nobody stopped this run within {HOLD_S:.0f}s")


def test_cluster(mooncake_cluster, tmp_path):
    # A child forked from a pool thread that then ends must outlive that thread.
    with ThreadPoolExecutor(1) as pool:
        sleeper = pool.submit(
            lambda: L.LocalProcess("sleeper", SLEEPER, tmp_path / "sleeper.log", {}).start()
        ).result()
    time.sleep(0.5)
    assert sleeper.running(), "a child started from a finished thread died with that thread"
    pids = {**mooncake_cluster.pids(), "sleeper": sleeper.pid}
    _report(pids=pids, log_dir=str(mooncake_cluster.log_dir))


def test_namespace(tmp_path):
    from mooncake_span_tools.lab.netns import NetnsTopology, TopologySpec

    topology = NetnsTopology(TopologySpec(hosts=("solo",)), log_dir=tmp_path / "netns").create()
    try:
        sleeper = topology.spawn("solo", "sleeper", SLEEPER)
        _report(
            pids={"sleeper": sleeper.pid},
            namespaces=topology.spec.namespaces(),
            state=str(topology.state_path),
        )
    finally:
        topology.destroy()
