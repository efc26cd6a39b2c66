"""A test run stopped partway leaves no process and no namespace behind.

Each case runs ``killed_run_case.py`` in a pytest of its own, waits until it
holds a real cluster (master and storage node) and a child forked from a
finished thread, or a namespace with a process in it, then signals it:

* SIGTERM: the run is interrupted as by Ctrl-C; finalizers stop everything
  gracefully (the storage node's log says it closed its store) and delete the
  namespaces;
* SIGKILL: no finalizer runs; every child still dies with the run (its
  parent-death signal), and the namespaces are removed when the next run starts.

Loopback and private namespaces only; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake_span_tools.lab.namespaces import _NETNS_DIR, _process_alive
from tests import checkout
from tests.conftest import require_netns
from tests.integration.killed_run_case import KILLED_RUN_FILE_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
CASE = Path(__file__).with_name("killed_run_case.py")
READY_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 60.0
CHILD_DEATH_TIMEOUT_S = 15.0
NODE_CLOSED = "closed"  # the storage node's last log line after a graceful stop
# The README's command (its addopts run it under xdist), with one worker: the
# inner run selects one case, and every idle worker would import the suite.
_PYTEST = [
    sys.executable,
    "-m",
    "pytest",
    "-q",
    "-p",
    "no:cacheprovider",
    "-n",
    "1",
]


def _start_run(tmp_path: Path, case: str) -> tuple[subprocess.Popen[str], dict, Path]:
    report = tmp_path / "held.json"
    log = tmp_path / "inner.log"
    env = {**os.environ, KILLED_RUN_FILE_ENV: str(report), "PYTHONPATH": checkout.PYTHONPATH}
    with open(log, "w") as out:
        run = subprocess.Popen(
            [*_PYTEST, f"--basetemp={tmp_path / 'inner'}", "-k", case, str(CASE)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not report.exists():
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            run.wait()
            pytest.fail(f"the inner run never held its children:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    held = json.loads(report.read_text())
    assert held["pytest_pid"] == run.pid
    assert all(_process_alive(pid) for pid in held["pids"].values()), held
    return run, held, log


def _wait_gone(pids: dict[str, int], timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = {name: pid for name, pid in pids.items() if _process_alive(pid)}
        if not alive:
            return {}
        time.sleep(0.1)
    return alive


def _stop_run(run: subprocess.Popen[str], sig: int, log: Path) -> int:
    run.send_signal(sig)
    try:
        return run.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
        pytest.fail(f"the inner run outlived {sig!r} by {EXIT_TIMEOUT_S:.0f}s:\n{log.read_text()}")


def _node_log(held: dict) -> str:
    return (Path(held["log_dir"]) / "node0.log").read_text(errors="replace")


def test_sigterm_runs_the_finalizers_and_leaves_no_process(tmp_path):
    run, held, log = _start_run(tmp_path, "cluster")
    code = _stop_run(run, signal.SIGTERM, log)
    assert code == pytest.ExitCode.INTERRUPTED, log.read_text()[-4000:]
    assert _wait_gone(held["pids"], CHILD_DEATH_TIMEOUT_S) == {}, log.read_text()[-4000:]
    # Stopped by the fixture's finalizer, not by the parent-death SIGKILL.
    assert _node_log(held).rstrip().endswith(NODE_CLOSED), _node_log(held)[-2000:]


def test_sigkill_still_takes_every_child_along(tmp_path):
    run, held, log = _start_run(tmp_path, "cluster")
    assert _stop_run(run, signal.SIGKILL, log) == -signal.SIGKILL
    assert _wait_gone(held["pids"], CHILD_DEATH_TIMEOUT_S) == {}, held
    # Nothing graceful happened: the node was killed, it did not close its store.
    assert not _node_log(held).rstrip().endswith(NODE_CLOSED)


def _namespaces_left(held: dict) -> list[str]:
    return [name for name in held["namespaces"] if (_NETNS_DIR / name).exists()]


@pytest.mark.netns
def test_sigterm_deletes_the_runs_namespaces(tmp_path):
    require_netns()
    run, held, log = _start_run(tmp_path, "namespace")
    assert _namespaces_left(held) == held["namespaces"]
    assert _stop_run(run, signal.SIGTERM, log) == pytest.ExitCode.INTERRUPTED
    assert _wait_gone(held["pids"], CHILD_DEATH_TIMEOUT_S) == {}
    assert _namespaces_left(held) == []
    assert not Path(held["state"]).exists()


@pytest.mark.netns
def test_namespaces_of_a_killed_run_go_when_the_next_run_starts(tmp_path):
    require_netns()
    run, held, log = _start_run(tmp_path, "namespace")
    assert _stop_run(run, signal.SIGKILL, log) == -signal.SIGKILL
    assert _wait_gone(held["pids"], CHILD_DEATH_TIMEOUT_S) == {}
    # The negative control: nothing removed them yet.
    assert _namespaces_left(held) == held["namespaces"]
    assert Path(held["state"]).exists()
    next_run = subprocess.run(
        [*_PYTEST, f"--basetemp={tmp_path / 'next'}", "--co", str(CASE)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": checkout.PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S,
    )
    assert next_run.returncode == 0, next_run.stdout + next_run.stderr
    assert _namespaces_left(held) == []
    assert not Path(held["state"]).exists()
