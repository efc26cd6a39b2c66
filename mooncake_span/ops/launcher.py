"""One launcher for the Mooncake server processes: etcd, masters, metadata server, storage nodes.

The command lines, readiness checks and errors ``LocalCluster`` and the lab's
``NetnsCluster`` share (docs/architecture.md, "Processes around the backend").
Standard library only: this module never imports ``mooncake``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
HTTP_PROBE_TIMEOUT_S = 1.0
READY_PREFIX = "READY "

HttpAnswer = tuple[int, str]


class ClusterStartError(RuntimeError):
    """A cluster process did not become ready; the message carries its log tail."""


class EarlyExitError(ClusterStartError):
    """A server process died while starting; often a port taken after it was probed."""


class Process(Protocol):
    """What the readiness checks need from a started process."""

    name: str
    log_path: Path

    def running(self) -> bool: ...

    def exit_code(self) -> int | None: ...

    def output_text(self) -> str: ...

    def log_tail(self) -> str: ...


class Site(Protocol):
    """Where processes run: this host, or one host of a namespace topology."""

    def start(self, name: str, argv: Sequence[str]) -> Process: ...

    def http_get(self, url: str, timeout_s: float) -> HttpAnswer | None: ...


def find_executable(name: str) -> str:
    """Locate a Mooncake/etcd executable: next to this interpreter first, then on PATH."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        hint = (
            "install etcd (e.g. apt-get install etcd-server)"
            if name == "etcd"
            else "install the Mooncake wheel (pip install 'mooncake-span[cpu]')"
        )
        raise FileNotFoundError(f"{name!r} not found next to {sys.executable} or on PATH; {hint}")
    return found


def http_get(url: str, timeout_s: float = HTTP_PROBE_TIMEOUT_S) -> HttpAnswer | None:
    """GET url; (status, body) for any HTTP answer, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None


def parse_health(answer: HttpAnswer | None) -> dict[str, object] | None:
    """A master's ``/health`` JSON object from an HTTP answer, None unless it is a 200 object."""
    if answer is None or answer[0] != 200:
        return None
    try:
        parsed = json.loads(answer[1])
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


@dataclass(frozen=True)
class MasterArgs:
    """The ``mooncake_master`` flags both cluster kinds use; ``None`` for a tunable keeps
    Mooncake's default. ``ha_etcd_endpoint`` is ``HOST:PORT``."""

    host: str
    rpc_port: int
    metrics_port: int
    http_metadata_port: int | None = None
    ha_etcd_endpoint: str | None = None
    enable_oplog: bool = False
    lease_ttl_ms: int | None = None
    client_ttl_s: int | None = None
    eviction_high_watermark_ratio: float | None = None
    eviction_ratio: float | None = None
    enable_offload: bool = False
    extra_args: tuple[str, ...] = ()

    def argv(self, master_bin: str) -> list[str]:
        argv = [
            master_bin,
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--metrics_host={self.host}",
            "--logtostderr",
        ]
        if self.http_metadata_port is not None:
            argv += [
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={self.http_metadata_port}",
                f"--http_metadata_server_host={self.host}",
            ]
        if self.ha_etcd_endpoint is not None:
            argv += [
                "--enable_ha=true",
                "--ha_backend_type=etcd",
                f"--ha_backend_connstring={self.ha_etcd_endpoint}",
            ]
            if self.enable_oplog:
                argv.append("--enable_oplog=true")
        tunables = {
            "default_kv_lease_ttl": self.lease_ttl_ms,
            "client_ttl": self.client_ttl_s,
            "eviction_high_watermark_ratio": self.eviction_high_watermark_ratio,
            "eviction_ratio": self.eviction_ratio,
            "enable_offload": "true" if self.enable_offload else None,
        }
        argv += [f"--{flag}={value}" for flag, value in tunables.items() if value is not None]
        return argv + list(self.extra_args)


def etcd_argv(
    etcd_bin: str, *, member: str, data_dir: Path, host: str, client_port: int, peer_port: int
) -> list[str]:
    """A single-member etcd cluster. ``data_dir`` should be fresh: a stale
    ``master_view`` key from an earlier run blocks master elections."""
    client_url = f"http://{host}:{client_port}"
    peer_url = f"http://{host}:{peer_port}"
    return [
        etcd_bin,
        f"--name={member}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={member}={peer_url}",
        "--initial-cluster-state=new",
    ]


@dataclass(frozen=True)
class NodeSsdArgs:
    root: Path
    node_name: str
    cap_bytes: int | None = None
    read_buffer_bytes: int | None = None
    admin_url: str | None = None
    client_ttl_s: int | None = None
    check: str | None = None  # None: the node's default (its MOONCAKE_SPAN_SSD_CHECK)

    def argv(self) -> list[str]:
        optional = {
            "ssd-check": self.check,
            "ssd-size": self.cap_bytes,
            "ssd-read-buffer": self.read_buffer_bytes,
            "admin-url": self.admin_url,
            "client-ttl-s": self.client_ttl_s,
        }
        given = [f"--{flag}={value}" for flag, value in optional.items() if value is not None]
        return [f"--ssd-dir={self.root}", f"--node-name={self.node_name}", *given]


def storage_node_argv(
    *,
    master: str,
    metadata: str,
    segment_bytes: int,
    local_buffer_bytes: int,
    host: str,
    ssd: NodeSsdArgs | None = None,
) -> list[str]:
    """``python -m mooncake_span.storage_node`` (the public path) with this interpreter."""
    return [
        sys.executable,
        "-m",
        "mooncake_span.storage_node",
        f"--master={master}",
        f"--metadata={metadata}",
        f"--segment-bytes={segment_bytes}",
        f"--local-buffer-bytes={local_buffer_bytes}",
        f"--host={host}",
        *(ssd.argv() if ssd is not None else ()),
    ]


def _early_exit(process: Process, what: str) -> EarlyExitError:
    return EarlyExitError(
        f"{process.name} exited with code {process.exit_code()} {what} "
        f"(log {process.log_path}):\n{process.log_tail()}"
    )


def wait_http(
    process: Process,
    site: Site,
    url: str,
    deadline: float,
    accept: Callable[[int, str], bool],
    *,
    wanted: str | None = None,
) -> HttpAnswer:
    """Poll ``url`` from ``site`` until ``accept(status, body)``; return that answer.

    Raises:
        EarlyExitError: the process exited first.
        ClusterStartError: ``deadline`` (a ``time.monotonic()`` value) passed.
    """
    while True:
        if not process.running():
            raise _early_exit(process, "while starting")
        answer = site.http_get(url, HTTP_PROBE_TIMEOUT_S)
        if answer is not None and accept(*answer):
            return answer
        if time.monotonic() >= deadline:
            raise ClusterStartError(
                f"{process.name} did not {wanted or f'answer {url}'} in time (last answer "
                f"{answer!r}; log {process.log_path}):\n{process.log_tail()}"
            )
        time.sleep(POLL_INTERVAL_S)


def etcd_healthy(status: int, body: str) -> bool:
    return status == 200 and '"true"' in body


def wait_master(
    process: Process, site: Site, metrics_url: str, deadline: float, *, serving: bool
) -> None:
    """Wait for a master's ``/health``; with ``serving`` also for ``service_ready: true``
    (``/health`` answers before the RPC port is bound)."""

    def accept(status: int, body: str) -> bool:
        health = parse_health((status, body))
        return health is not None and (not serving or health.get("service_ready") is True)

    wanted = "serve" if serving else "answer /health"
    wait_http(process, site, metrics_url + "/health", deadline, accept, wanted=wanted)


def wait_ready_line(process: Process, deadline: float) -> None:
    while True:
        if any(line.startswith(READY_PREFIX) for line in process.output_text().splitlines()):
            return
        if not process.running():
            raise _early_exit(process, "before READY")
        if time.monotonic() >= deadline:
            raise ClusterStartError(
                f"{process.name} printed no READY line in time (log {process.log_path}):\n"
                f"{process.log_tail()}"
            )
        time.sleep(POLL_INTERVAL_S)


def serving_leader(health: dict[str, object] | None) -> bool:
    return bool(health) and health.get("role") == "leader" and health.get("service_ready") is True


def wait_for_leader(
    healths: Callable[[], Sequence[dict[str, object] | None]], timeout_s: float
) -> int:
    """Poll ``healths()`` (one ``/health`` per master, None for a silent one) until
    some master is a serving leader; return its index, or raise TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while True:
        for i, health in enumerate(healths()):
            if serving_leader(health):
                return i
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no master became a serving leader within {timeout_s:.0f}s")
        time.sleep(POLL_INTERVAL_S * 4)


def start_masters(
    site_of: Callable[[int], Site],
    names: Sequence[str],
    argvs: Sequence[Sequence[str]],
    metrics_urls: Sequence[str],
    deadline: float,
    record: Callable[[int, Process], None],
) -> None:
    """Start the masters, handing each process to ``record`` as soon as it exists
    (so the caller can stop it if a later step fails). Master 0 serves before the
    others start, so it is the first leader; the others may stay standbys."""
    first = site_of(0).start(names[0], argvs[0])
    record(0, first)
    wait_master(first, site_of(0), metrics_urls[0], deadline, serving=True)
    others = []
    for i in range(1, len(names)):
        others.append(site_of(i).start(names[i], argvs[i]))
        record(i, others[-1])
    for i, process in enumerate(others, start=1):
        wait_master(process, site_of(i), metrics_urls[i], deadline, serving=False)


def read_text_from(path: Path, offset: int) -> str:
    """The text of ``path`` after byte ``offset`` (a restart appends to the same log)."""
    try:
        with open(path, "rb") as log_file:
            log_file.seek(offset)
            return log_file.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when the thread that forked it ends
    (docs/development.md: a killed run leaves no servers behind). The ``getppid``
    check catches a parent that died before the ``prctl``."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork, not in the child

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


# The parent-death signal follows the *thread* that forked: a child of a
# short-lived worker thread would die with it, so one daemon thread forks for all
# threads but the main one.
_fork_requests: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
_forker_lock = threading.Lock()
_forker: threading.Thread | None = None


def _fork_loop() -> None:
    while True:
        fn, future = _fork_requests.get()
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed back to the caller's thread
            future.set_exception(exc)


def popen_tied(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)`` for a child that dies with this process."""
    global _forker

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(list(argv), preexec_fn=die_with_parent(os.getpid()), **kwargs)

    if threading.current_thread() is threading.main_thread():
        return start()
    with _forker_lock:
        if _forker is None:
            _forker = threading.Thread(target=_fork_loop, name="mooncake-span-forker", daemon=True)
            _forker.start()
    future: Future[subprocess.Popen[bytes]] = Future()
    _fork_requests.put((start, future))
    return future.result()


class LocalProcess:
    """One child process in its own session, appending stdout and stderr to a file;
    it dies with this process (``popen_tied``). ``start()`` again after an exit
    restarts it; output checks then see only the new run's output."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str]):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env)
        self.popen: subprocess.Popen[bytes] | None = None
        self.log_offset = 0

    def start(self) -> LocalProcess:
        with open(self.log_path, "ab") as log_file:
            log_file.write(
                f"=== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode()
            )
            log_file.flush()
            self.log_offset = log_file.tell()
            self.popen = popen_tied(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                close_fds=True,
            )
        logger.debug("started %s pid=%d: %s", self.name, self.popen.pid, " ".join(self.argv))
        return self

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def _peek_exit(self) -> os.waitid_result | None | bool:
        """The exit record without reaping (False: no such child any more)."""
        assert self.popen is not None
        try:
            return os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False

    def running(self) -> bool:
        """True while the process has not exited. Never reaps it (see ``reap``)."""
        if self.popen is None or self.popen.returncode is not None:
            return False
        return self._peek_exit() is None

    def exit_code(self) -> int | None:
        if self.popen is None:
            return None
        if self.popen.returncode is not None:
            return self.popen.returncode
        info = self._peek_exit()
        if not info:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def output_text(self) -> str:
        """What the current run wrote (stdout and stderr)."""
        return read_text_from(self.log_path, self.log_offset)

    def log_tail(self, lines: int = 40) -> str:
        text = self.output_text().splitlines()[-lines:]
        return "\n".join(f"    {line[:400]}" for line in text) or "    (empty)"

    def signal_group(self, sig: int) -> None:
        if self.popen is None or self.popen.returncode is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait_exit(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_INTERVAL_S)
        return True

    def reap(self) -> None:
        """Kill whatever is left in the group and collect the exit status; the leader,
        an unreaped zombie until then, keeps the group id from being recycled."""
        if self.popen is None or self.popen.returncode is not None:
            return
        self.signal_group(signal.SIGKILL)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("%s pid=%d did not exit even after SIGKILL", self.name, self.popen.pid)


def terminate(processes: Iterable[LocalProcess], sig: int, grace_s: float) -> None:
    """Signal all processes' groups at once, wait up to grace_s, then SIGKILL."""
    processes = [p for p in processes if p.popen is not None]
    for process in processes:
        if process.running():
            process.signal_group(sig)
    deadline = time.monotonic() + grace_s
    for process in processes:
        if not process.wait_exit(max(0.0, deadline - time.monotonic())):
            logger.warning(
                "%s pid=%s ignored %s for %.1fs; sending SIGKILL",
                process.name,
                process.pid,
                signal.Signals(sig).name,
                grace_s,
            )
            process.signal_group(signal.SIGKILL)
            process.wait_exit(10.0)
        process.reap()


class LocalSite:
    """Start processes on this host, logging to ``<log_dir>/<name>.log``."""

    def __init__(self, log_dir: Path, env: dict[str, str]):
        self.log_dir = log_dir
        self.env = dict(env)

    def start(self, name: str, argv: Sequence[str]) -> LocalProcess:
        return LocalProcess(name, argv, self.log_dir / f"{name}.log", self.env).start()

    def http_get(self, url: str, timeout_s: float) -> HttpAnswer | None:
        return http_get(url, timeout_s)


# Below the kernel's ephemeral range, where no outgoing connection's source port can
# take a port between our probe and the server's bind (docs/development.md); above
# Mooncake's own random ports (12000-17000).
_LISTEN_PORTS_LOW = 20000
_PICK_ATTEMPTS = 500


def pick_free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports that were free on ``host`` a moment ago, below the
    ephemeral range where there is room (else any the kernel hands out)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            candidates = range(_LISTEN_PORTS_LOW, int(fh.read().split()[0]))
    except (OSError, ValueError, IndexError):
        candidates = range(0)
    # Hold all sockets open until every port is chosen so they are distinct.
    sockets: list[socket.socket] = []
    try:
        for attempt in range(_PICK_ATTEMPTS + count):
            if len(sockets) == count:
                break
            port = random.choice(candidates) if candidates and attempt < _PICK_ATTEMPTS else 0
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                if not port:
                    raise
                continue
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
