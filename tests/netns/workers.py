"""Start ``node_worker`` processes in namespaces and collect their JSON reports."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mooncake_span_tools.lab.netns import NetnsCluster, NetnsProcess, NetnsTopology
from tests import checkout

WORKER_MODULE = "tests.netns.node_worker"
# sglang's import alone takes 10-20 s per process on 2 busy cores.
WORKER_TIMEOUT_S = 240.0
_POLL_INTERVAL_S = 0.05


def spawn_worker(
    topology: NetnsTopology,
    cluster: NetnsCluster,
    host: str,
    name: str,
    mode: str,
    *args: str,
    segment_bytes: int = 0,
) -> NetnsProcess:
    """``node_worker MODE`` on ``host`` against ``cluster``; stdout (the JSON) to its own file."""
    argv = [
        sys.executable,
        "-m",
        WORKER_MODULE,
        mode,
        "--master",
        cluster.master_address,
        "--metadata",
        cluster.metadata_server,
        "--local-hostname",
        topology.address(host),
        "--segment-bytes",
        str(segment_bytes),
        *args,
    ]
    return topology.spawn(
        host, name, argv, separate_stdout=True, env={"PYTHONPATH": checkout.PYTHONPATH}
    )


def report_of(process: NetnsProcess, timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
    """Wait for the worker and return its JSON report plus ``returncode``."""
    code = process.wait(timeout_s)
    if code is None:
        process.stop(1.0)
        raise AssertionError(
            f"worker {process.name} still running after {timeout_s:.0f}s "
            f"(log {process.log_path}):\n"
            f"{process.log_tail()}"
        )
    for line in reversed(process.stdout_text().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                report = json.loads(line)
            except ValueError:
                continue
            report["returncode"] = code
            return report
    raise AssertionError(
        f"worker {process.name} exited with {code} without a JSON report "
        f"(log {process.log_path}):\n"
        f"{process.log_tail()}"
    )


def wait_for_files(
    paths: Iterable[Path], watch: Sequence[NetnsProcess], timeout_s: float = WORKER_TIMEOUT_S
) -> None:
    """Wait until every path exists.

    Fails early when a watched process exits with an error, or when all of
    them have exited and a path is still missing.
    """
    pending = list(paths)
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [p for p in pending if not p.exists()]
        if not pending:
            return
        failed = [p for p in watch if not p.running() and p.returncode != 0]
        if failed or (watch and all(not p.running() for p in watch)):
            pending = [p for p in pending if not p.exists()]
            if not pending:
                return
            details = "\n".join(
                f"{p.name} exited {p.returncode}:\n{p.log_tail(15)}" for p in failed or watch
            )
            raise AssertionError(
                f"waiting for {[str(p) for p in pending]}, but workers exited:\n{details}"
            )
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"{[str(p) for p in pending]} did not appear within {timeout_s:.0f}s"
            )
        time.sleep(_POLL_INTERVAL_S)


def touch(path: Path, text: str = "") -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def mib_per_s(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / (1 << 20) / seconds, 1) if seconds > 0 else None
