"""Start and stop a local Mooncake cluster from Python (tests, demos, benches).

A cluster is a set of child processes on one host, all bound to ``spec.host``
on ports picked fresh at each start:

* optionally one ``etcd`` (HA election, and metadata in HA mode);
* optionally a standalone ``mooncake_http_metadata_server``;
* ``ha_masters`` x ``mooncake_master``;
* ``storage_nodes`` x ``python -m mooncake_span.storage_node``: processes
  that only contribute memory, so stored data outlives the writing client.

Where the transfer metadata lives:

* ``standalone_metadata=True``: the standalone HTTP metadata server;
* otherwise, with ``ha_masters > 1``: etcd (it must not live inside one master,
  or a failover would lose it);
* otherwise: the HTTP metadata server embedded in the master.

Every child runs in its own session with stdout and stderr appended to
``<log_dir>/<name>.log``. ``stop()`` sends SIGTERM to each process group,
waits, then SIGKILLs; it is idempotent and also runs at interpreter exit.

This module needs only the standard library and the Mooncake executables; it
never imports ``mooncake``, so it loads on machines without the wheel.

Not thread-safe: drive one ``LocalCluster`` from one thread.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from mooncake_span.config import validate_master_address, validate_metadata_server
from mooncake_span.units import parse_size_bytes

logger = logging.getLogger(__name__)

__all__ = [
    "ClusterSpec",
    "ClusterStartError",
    "ExternalCluster",
    "LocalCluster",
    "find_executable",
    "validate_master_address",
    "validate_metadata_server",
]

# Attempts at a whole start when a server dies during startup. The master
# exits silently when its RPC port was taken between our probe and its bind.
_START_ATTEMPTS = 3
_POLL_INTERVAL_S = 0.05
_HTTP_PROBE_TIMEOUT_S = 1.0
_LOG_TAIL_LINES = 40
_READY_PREFIX = "READY "


class ClusterStartError(RuntimeError):
    """A cluster component did not become ready; the message carries its log tail."""


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


# ---------------------------------------------------------------------------
# spec


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. All fields are validated on construction.

    Sizes accept ints or strings such as ``"512mb"`` and are stored as ints.
    ``None`` for a master tunable keeps Mooncake's default (lease 10 s,
    client TTL 10 s, eviction high watermark 0.9).
    """

    host: str = "127.0.0.1"
    storage_nodes: int = 0
    storage_node_segment_bytes: int = 256 << 20
    storage_node_local_buffer_bytes: int = 16 << 20
    etcd: bool = False
    standalone_metadata: bool = False
    ha_masters: int = 1
    enable_oplog: bool = False
    lease_ttl_ms: int | None = None
    client_ttl_s: int | None = None
    eviction_high_watermark_ratio: float | None = None
    master_extra_args: tuple[str, ...] = ()
    log_dir: str | Path | None = None
    # Added to the environment of every child and to client_env().
    env_overrides: Mapping[str, str] = field(default_factory=dict, hash=False)
    start_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        try:
            address = ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(
                f"ClusterSpec.host={self.host!r} is not an IP address; use a local IPv4 address "
                f"such as '127.0.0.1'"
            ) from None
        if address.version != 4:
            raise ValueError(f"ClusterSpec.host={self.host!r}: only IPv4 addresses are supported")
        _require_int(self.storage_nodes, "storage_nodes", minimum=0)
        _require_int(self.ha_masters, "ha_masters", minimum=1)
        for name in ("storage_node_segment_bytes", "storage_node_local_buffer_bytes"):
            try:
                size_bytes = parse_size_bytes(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"ClusterSpec.{name}: {exc}") from None
            object.__setattr__(self, name, size_bytes)
        if self.storage_nodes and self.storage_node_segment_bytes <= 0:
            raise ValueError(
                f"ClusterSpec.storage_node_segment_bytes must be > 0 when storage_nodes="
                f"{self.storage_nodes}; a storage node exists to contribute memory"
            )
        if self.ha_masters > 1 and not self.etcd:
            raise ValueError(
                f"ClusterSpec(ha_masters={self.ha_masters}) needs etcd for leader election; "
                f"set etcd=True (--etcd on the command line) or ha_masters=1"
            )
        if self.enable_oplog and self.ha_masters < 2:
            raise ValueError(
                "ClusterSpec.enable_oplog replicates metadata between HA masters; "
                "set ha_masters >= 2 (and etcd=True), or drop enable_oplog"
            )
        if self.lease_ttl_ms is not None:
            _require_int(self.lease_ttl_ms, "lease_ttl_ms", minimum=1)
        if self.client_ttl_s is not None:
            _require_int(self.client_ttl_s, "client_ttl_s", minimum=1)
        ratio = self.eviction_high_watermark_ratio
        if ratio is not None and (
            isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1
        ):
            raise ValueError(
                f"ClusterSpec.eviction_high_watermark_ratio={ratio!r} must be a number in (0, 1]"
            )
        if isinstance(self.master_extra_args, str) or not all(
            isinstance(arg, str) and arg.startswith("--") for arg in self.master_extra_args
        ):
            raise ValueError(
                f"ClusterSpec.master_extra_args={self.master_extra_args!r} must be a tuple of "
                f"'--flag=value' strings"
            )
        object.__setattr__(self, "master_extra_args", tuple(self.master_extra_args))
        env = dict(self.env_overrides)
        for key, value in env.items():
            if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
                raise ValueError(
                    f"ClusterSpec.env_overrides entry {key!r}={value!r}: names and values "
                    f"must be strings and names must not contain '='"
                )
        object.__setattr__(self, "env_overrides", MappingProxyType(env))
        for name in ("start_timeout_s", "stop_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"ClusterSpec.{name}={value!r} must be a positive number")

    @property
    def ha(self) -> bool:
        """Whether the masters run in etcd-backed HA mode (``ha_masters > 1``)."""
        return self.ha_masters > 1

    @property
    def metadata_mode(self) -> str:
        """``"standalone"``, ``"etcd"`` or ``"embedded"``; see the module docstring."""
        if self.standalone_metadata:
            return "standalone"
        if self.ha:
            return "etcd"
        return "embedded"


def _require_int(value: object, name: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ClusterSpec.{name}={value!r} must be an int >= {minimum}")


# ---------------------------------------------------------------------------
# an external cluster, for fixtures pointed at an already running deployment


@dataclass(frozen=True)
class ExternalCluster:
    """A cluster someone else runs; offers the client-facing half of LocalCluster's API."""

    master_address: str
    metadata_server: str
    host: str = "127.0.0.1"
    env: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        validate_master_address(self.master_address)
        validate_metadata_server(self.metadata_server)
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    def client_config(self, global_segment_size_bytes: int = 0) -> dict[str, object]:
        return _client_config(
            self.master_address, self.metadata_server, self.host, global_segment_size_bytes
        )

    def client_env(self) -> dict[str, str]:
        return {"MC_TCP_BIND_ADDRESS": self.host, **self.env}


def _client_config(
    master_address: str, metadata_server: str, host: str, global_segment_size_bytes: int
) -> dict[str, object]:
    size_bytes = parse_size_bytes(global_segment_size_bytes)
    # Key names are the ones SGLang's Mooncake extra-config understands.
    return {
        "master_server_address": master_address,
        "metadata_server": metadata_server,
        "protocol": "tcp",
        "local_hostname": host,
        "global_segment_size": size_bytes,
    }


# ---------------------------------------------------------------------------
# child processes


class _Child:
    """One child process in its own session, logging to a file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: Mapping[str, str]):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = dict(env)
        self.popen: subprocess.Popen[bytes] | None = None
        self.log_offset = 0

    def start(self) -> None:
        with open(self.log_path, "ab") as log_file:
            log_file.write(
                f"=== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode()
            )
            log_file.flush()
            self.log_offset = log_file.tell()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                close_fds=True,
            )
        logger.debug("started %s pid=%d: %s", self.name, self.popen.pid, " ".join(self.argv))

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def running(self) -> bool:
        """True while the process has not exited. Never reaps it (see _terminate)."""
        if self.popen is None or self.popen.returncode is not None:
            return False
        try:
            info = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        return info is None

    def exit_code(self) -> int | None:
        if self.popen is None:
            return None
        if self.popen.returncode is not None:
            return self.popen.returncode
        try:
            info = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def output_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(self.log_offset)
                return log_file.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        text = self.output_since_start().splitlines()[-lines:]
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
            time.sleep(_POLL_INTERVAL_S)
        return True

    def reap(self) -> None:
        """Kill whatever is left in the group and collect the exit status.

        The leader is still an unreaped zombie here, which keeps its process
        group id reserved, so the final SIGKILL cannot hit a recycled group.
        """
        if self.popen is None or self.popen.returncode is not None:
            return
        self.signal_group(signal.SIGKILL)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("%s pid=%d did not exit even after SIGKILL", self.name, self.popen.pid)


def _terminate(children: Iterable[_Child], sig: int, grace_s: float) -> None:
    """Signal all children's groups at once, wait up to grace_s, then SIGKILL."""
    children = [child for child in children if child.popen is not None]
    for child in children:
        if child.running():
            child.signal_group(sig)
    deadline = time.monotonic() + grace_s
    for child in children:
        if not child.wait_exit(max(0.0, deadline - time.monotonic())):
            logger.warning(
                "%s pid=%s ignored %s for %.1fs; sending SIGKILL",
                child.name,
                child.pid,
                signal.Signals(sig).name,
                grace_s,
            )
            child.signal_group(signal.SIGKILL)
            child.wait_exit(10.0)
        child.reap()


def _pick_free_ports(host: str, count: int) -> list[int]:
    # Hold all sockets open until every port is chosen so they are distinct.
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _http_get(url: str, timeout_s: float = _HTTP_PROBE_TIMEOUT_S) -> tuple[int, str] | None:
    """GET url; (status, body) for any HTTP answer, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None


def _health(metrics_base_url: str) -> dict[str, object] | None:
    answer = _http_get(metrics_base_url + "/health")
    if answer is None or answer[0] != 200:
        return None
    try:
        parsed = json.loads(answer[1])
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


@dataclass(frozen=True)
class _Ports:
    master_rpc: tuple[int, ...]
    master_metrics: tuple[int, ...]
    metadata_http: int | None
    etcd_client: int | None
    etcd_peer: int | None


class _EarlyExit(ClusterStartError):
    """A server process died while starting; often a port taken after we probed it."""


# Clusters still running at interpreter exit get stopped, so an exception that
# escapes a test or script does not leave servers behind. Strong references:
# a started cluster that its owner forgot must still be found here.
_LIVE_CLUSTERS: set[LocalCluster] = set()


@atexit.register
def _stop_live_clusters() -> None:
    for cluster in list(_LIVE_CLUSTERS):
        cluster.stop()


class LocalCluster:
    """A Mooncake cluster of child processes on this host.

    Use as a context manager, or call ``start()`` and ``stop()``::

        with LocalCluster(ClusterSpec(storage_nodes=1)) as cluster:
            store.setup(..., cluster.metadata_server, ..., cluster.master_address)
    """

    def __init__(self, spec: ClusterSpec | None = None):
        self.spec = spec if spec is not None else ClusterSpec()
        self._log_dir: Path | None = None
        self._ports: _Ports | None = None
        self._etcd: _Child | None = None
        self._metadata: _Child | None = None
        self._masters: list[_Child] = []
        self._nodes: list[_Child] = []
        self._started = False

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> LocalCluster:
        """Start everything; return once masters serve and storage nodes are READY.

        Raises:
            FileNotFoundError: an executable is missing.
            ClusterStartError: a component died or missed ``spec.start_timeout_s``;
                the message includes its log tail. Nothing is left running.
            RuntimeError: the cluster is already started.
        """
        if self._started:
            raise RuntimeError("LocalCluster.start() called twice; call stop() first")
        spec = self.spec
        master_bin = find_executable("mooncake_master")
        etcd_bin = find_executable("etcd") if spec.etcd else None
        metadata_bin = (
            find_executable("mooncake_http_metadata_server") if spec.standalone_metadata else None
        )
        self._log_dir = self._prepare_log_dir()
        self._etcd = self._metadata = None
        self._masters, self._nodes = [], []
        self._started = True
        _LIVE_CLUSTERS.add(self)
        deadline = time.monotonic() + spec.start_timeout_s
        try:
            for attempt in range(1, _START_ATTEMPTS + 1):
                self._ports = self._pick_ports()
                try:
                    self._start_servers(master_bin, etcd_bin, metadata_bin, attempt, deadline)
                    break
                except _EarlyExit as exc:
                    if attempt == _START_ATTEMPTS:
                        raise
                    logger.warning(
                        "cluster start attempt %d/%d failed, retrying on fresh ports: %s",
                        attempt,
                        _START_ATTEMPTS,
                        str(exc).splitlines()[0],
                    )
                    self._stop_children()
            self._nodes = [self._make_node(i) for i in range(spec.storage_nodes)]
            for node in self._nodes:
                node.start()
            for node in self._nodes:
                self._wait_node_ready(node, deadline)
        except BaseException:
            self.stop()
            raise
        logger.info(
            "mooncake cluster up: master=%s metadata=%s storage_nodes=%d logs=%s",
            self.master_address,
            self.metadata_server,
            spec.storage_nodes,
            self._log_dir,
        )
        return self

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL after ``spec.stop_timeout_s``). Idempotent."""
        if not self._started:
            return
        try:
            self._stop_children()
        finally:
            self._started = False
            _LIVE_CLUSTERS.discard(self)

    def __enter__(self) -> LocalCluster:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def started(self) -> bool:
        return self._started

    # -- addresses -----------------------------------------------------------

    @property
    def master_address(self) -> str:
        """``HOST:PORT`` of the master, or ``etcd://HOST:PORT`` in HA mode."""
        ports = self._require_ports()
        if self.spec.ha:
            return f"etcd://{self.spec.host}:{ports.etcd_client}"
        return f"{self.spec.host}:{ports.master_rpc[0]}"

    @property
    def metadata_server(self) -> str:
        """The ``metadata_server`` string clients pass to ``setup()``."""
        ports = self._require_ports()
        if self.spec.metadata_mode == "etcd":
            return f"etcd://{self.spec.host}:{ports.etcd_client}"
        return f"http://{self.spec.host}:{ports.metadata_http}/metadata"

    @property
    def metrics_url(self) -> str:
        """Base URL of master 0's admin server (``/health``, ``/metrics``, ``/metrics/summary``)."""
        return self.master_metrics_url(0)

    def master_metrics_url(self, i: int = 0) -> str:
        ports = self._require_ports()
        return f"http://{self.spec.host}:{ports.master_metrics[self._master_index(i)]}"

    @property
    def etcd_endpoint(self) -> str | None:
        """``HOST:PORT`` of etcd's client URL (as etcdctl/etcd3gw take it), None without etcd."""
        ports = self._require_ports()
        if ports.etcd_client is None:
            return None
        return f"{self.spec.host}:{ports.etcd_client}"

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            raise RuntimeError("LocalCluster has no log dir yet; call start() first")
        return self._log_dir

    def client_config(self, global_segment_size_bytes: int = 0) -> dict[str, object]:
        """Client settings; the keys match SGLang's Mooncake ``extra_config`` keys."""
        return _client_config(
            self.master_address, self.metadata_server, self.spec.host, global_segment_size_bytes
        )

    def client_env(self) -> dict[str, str]:
        """Environment variables a client process needs to talk to this cluster."""
        return {"MC_TCP_BIND_ADDRESS": self.spec.host, **self.spec.env_overrides}

    def pids(self) -> dict[str, int]:
        """PIDs of the processes that are currently running, by name (``master0``, ``node1``...)."""
        children = [self._etcd, self._metadata, *self._masters, *self._nodes]
        return {
            child.name: child.popen.pid
            for child in children
            if child is not None and child.popen is not None and child.running()
        }

    # -- observation ---------------------------------------------------------

    def summary(self, i: int = 0) -> str:
        """Master i's ``/metrics/summary`` text (role, state, memory, keys, clients).

        Raises:
            ConnectionError: the master does not answer.
        """
        url = self.master_metrics_url(i) + "/metrics/summary"
        answer = _http_get(url, timeout_s=2.0)
        if answer is None or answer[0] != 200:
            raise ConnectionError(f"master {i} did not answer {url} (got {answer!r})")
        return answer[1]

    def leader_index(self) -> int | None:
        """Index of the master whose summary says ``role=leader``, None if none answers so."""
        for i, master in enumerate(self._masters):
            if not master.running():
                continue
            try:
                text = self.summary(i)
            except ConnectionError:
                continue
            if re.search(r"\brole=leader\b", text):
                return i
        return None

    def wait_for_leader(self, timeout_s: float = 30.0) -> int:
        """Wait until some master is leader and serving; return its index.

        Raises:
            TimeoutError: no master became a serving leader in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            for i, master in enumerate(self._masters):
                if master.running():
                    health = _health(self.master_metrics_url(i))
                    if health and health.get("role") == "leader" and health.get("service_ready"):
                        return i
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no master became a serving leader within {timeout_s:.0f}s")
            time.sleep(_POLL_INTERVAL_S * 4)

    # -- fault injection -----------------------------------------------------

    def kill_storage_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to storage node i's process group and wait for it to exit."""
        node = self._nodes[self._node_index(i)]
        _terminate([node], sig, self.spec.stop_timeout_s)

    def restart_storage_node(self, i: int) -> None:
        """(Re)start storage node i and wait for READY; a running node is stopped first."""
        index = self._node_index(i)
        node = self._nodes[index]
        if node.running():
            _terminate([node], signal.SIGTERM, self.spec.stop_timeout_s)
        node.start()
        try:
            self._wait_node_ready(node, time.monotonic() + self.spec.start_timeout_s)
        except BaseException:
            _terminate([node], signal.SIGKILL, self.spec.stop_timeout_s)
            raise

    def kill_master(self, i: int = 0, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to master i's process group and wait for it to exit."""
        master = self._masters[self._master_index(i)]
        _terminate([master], sig, self.spec.stop_timeout_s)

    def restart_master(self, i: int = 0) -> None:
        """(Re)start master i on its old ports.

        Returns once it serves (single master) or answers ``/health`` (HA: it
        may come back as a standby). A non-HA master restarts empty; storage
        nodes re-register their segments by themselves shortly after.
        """
        index = self._master_index(i)
        master = self._masters[index]
        if master.running():
            _terminate([master], signal.SIGTERM, self.spec.stop_timeout_s)
        master.start()
        try:
            self._wait_master(
                index, time.monotonic() + self.spec.start_timeout_s, serving=not self.spec.ha
            )
        except BaseException:
            _terminate([master], signal.SIGKILL, self.spec.stop_timeout_s)
            raise

    # -- internals -----------------------------------------------------------

    def _require_ports(self) -> _Ports:
        if self._ports is None or not self._started:
            raise RuntimeError("LocalCluster is not running; call start() first")
        return self._ports

    def _master_index(self, i: int) -> int:
        self._require_ports()
        if not 0 <= i < self.spec.ha_masters:
            raise IndexError(f"master index {i} out of range (ha_masters={self.spec.ha_masters})")
        return i

    def _node_index(self, i: int) -> int:
        self._require_ports()
        if not 0 <= i < len(self._nodes):
            raise IndexError(
                f"storage node index {i} out of range (storage_nodes={self.spec.storage_nodes})"
            )
        return i

    def _prepare_log_dir(self) -> Path:
        if self.spec.log_dir is None:
            # Kept after stop(): the logs are what you want when something failed.
            return Path(tempfile.mkdtemp(prefix="mooncake-span-cluster-"))
        log_dir = Path(self.spec.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        return log_dir

    def _pick_ports(self) -> _Ports:
        spec = self.spec
        need_http = spec.metadata_mode in ("embedded", "standalone")
        count = 2 * spec.ha_masters + (1 if need_http else 0) + (2 if spec.etcd else 0)
        ports = iter(_pick_free_ports(spec.host, count))
        rpc = tuple(next(ports) for _ in range(spec.ha_masters))
        metrics = tuple(next(ports) for _ in range(spec.ha_masters))
        metadata_http = next(ports) if need_http else None
        etcd_client = next(ports) if spec.etcd else None
        etcd_peer = next(ports) if spec.etcd else None
        return _Ports(rpc, metrics, metadata_http, etcd_client, etcd_peer)

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.client_env())
        # Children print through Python's stdout; unbuffered so READY lands at once.
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _start_servers(
        self,
        master_bin: str,
        etcd_bin: str | None,
        metadata_bin: str | None,
        attempt: int,
        deadline: float,
    ) -> None:
        spec = self.spec
        ports = self._require_ports()
        log_dir = self.log_dir
        env = self._child_env()
        host = spec.host
        if etcd_bin is not None:
            data_dir = log_dir / f"etcd-data-{attempt}"
            # A stale master_view key from an earlier run would block elections.
            shutil.rmtree(data_dir, ignore_errors=True)
            client_url = f"http://{host}:{ports.etcd_client}"
            peer_url = f"http://{host}:{ports.etcd_peer}"
            self._etcd = _Child(
                "etcd",
                [
                    etcd_bin,
                    "--name=mooncake-span",
                    f"--data-dir={data_dir}",
                    f"--listen-client-urls={client_url}",
                    f"--advertise-client-urls={client_url}",
                    f"--listen-peer-urls={peer_url}",
                    f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=mooncake-span={peer_url}",
                    "--initial-cluster-state=new",
                ],
                log_dir / "etcd.log",
                env,
            )
            self._etcd.start()
            self._wait_http(
                self._etcd,
                client_url + "/health",
                deadline,
                lambda status, body: status == 200 and '"true"' in body,
            )
        if metadata_bin is not None:
            self._metadata = _Child(
                "metadata",
                [metadata_bin, f"--port={ports.metadata_http}", f"--host={host}"],
                log_dir / "metadata.log",
                env,
            )
            self._metadata.start()
            # Any HTTP answer (a 404 for an unknown key included) means it serves.
            self._wait_http(
                self._metadata,
                f"http://{host}:{ports.metadata_http}/metadata?key=mooncake-span-probe",
                deadline,
                lambda status, body: True,
            )
        self._masters = [
            _Child(f"master{i}", self._master_argv(master_bin, i), log_dir / f"master{i}.log", env)
            for i in range(spec.ha_masters)
        ]
        # Master 0 is started alone and waited for, so in HA mode it is
        # deterministically the first leader.
        self._masters[0].start()
        self._wait_master(0, deadline, serving=True)
        for i in range(1, spec.ha_masters):
            self._masters[i].start()
        for i in range(1, spec.ha_masters):
            self._wait_master(i, deadline, serving=False)

    def _master_argv(self, master_bin: str, i: int) -> list[str]:
        spec = self.spec
        ports = self._require_ports()
        host = spec.host
        argv = [
            master_bin,
            f"--rpc_port={ports.master_rpc[i]}",
            f"--rpc_address={host}",
            f"--metrics_port={ports.master_metrics[i]}",
            f"--metrics_host={host}",
            "--logtostderr",
        ]
        if spec.metadata_mode == "embedded":
            argv += [
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={ports.metadata_http}",
                f"--http_metadata_server_host={host}",
            ]
        if spec.ha:
            argv += [
                "--enable_ha=true",
                "--ha_backend_type=etcd",
                f"--ha_backend_connstring={host}:{ports.etcd_client}",
            ]
            if spec.enable_oplog:
                argv.append("--enable_oplog=true")
        if spec.lease_ttl_ms is not None:
            argv.append(f"--default_kv_lease_ttl={spec.lease_ttl_ms}")
        if spec.client_ttl_s is not None:
            argv.append(f"--client_ttl={spec.client_ttl_s}")
        if spec.eviction_high_watermark_ratio is not None:
            argv.append(f"--eviction_high_watermark_ratio={spec.eviction_high_watermark_ratio}")
        argv += spec.master_extra_args
        return argv

    def _make_node(self, i: int) -> _Child:
        spec = self.spec
        argv = [
            sys.executable,
            "-m",
            "mooncake_span.storage_node",
            f"--master={self.master_address}",
            f"--metadata={self.metadata_server}",
            f"--segment-bytes={spec.storage_node_segment_bytes}",
            f"--local-buffer-bytes={spec.storage_node_local_buffer_bytes}",
            f"--host={spec.host}",
        ]
        return _Child(f"node{i}", argv, self.log_dir / f"node{i}.log", self._child_env())

    def _wait_http(
        self, child: _Child, url: str, deadline: float, accept: Callable[[int, str], bool]
    ) -> None:
        while True:
            if not child.running():
                raise _EarlyExit(
                    f"{child.name} exited with code {child.exit_code()} while starting "
                    f"(log {child.log_path}):\n{child.log_tail()}"
                )
            answer = _http_get(url)
            if answer is not None and accept(*answer):
                return
            if time.monotonic() >= deadline:
                raise ClusterStartError(
                    f"{child.name} did not answer {url} within {self.spec.start_timeout_s:.0f}s "
                    f"(last answer {answer!r}; log {child.log_path}):\n{child.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _wait_master(self, i: int, deadline: float, *, serving: bool) -> None:
        master = self._masters[i]
        url = self.master_metrics_url(i)
        last: dict[str, object] | None = None
        while True:
            if not master.running():
                raise _EarlyExit(
                    f"{master.name} exited with code {master.exit_code()} while starting "
                    f"(log {master.log_path}):\n{master.log_tail()}"
                )
            last = _health(url)
            # /health answers before the RPC server has bound its port; only
            # service_ready=true proves the master can take client calls.
            if last is not None and (not serving or last.get("service_ready") is True):
                return
            if time.monotonic() >= deadline:
                wanted = "serve" if serving else "answer /health"
                raise ClusterStartError(
                    f"{master.name} did not {wanted} within {self.spec.start_timeout_s:.0f}s "
                    f"(last /health {last!r}; log {master.log_path}):\n{master.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _wait_node_ready(self, node: _Child, deadline: float) -> None:
        while True:
            output = node.output_since_start()
            if any(line.startswith(_READY_PREFIX) for line in output.splitlines()):
                return
            if not node.running():
                raise ClusterStartError(
                    f"storage {node.name} exited with code {node.exit_code()} before READY "
                    f"(log {node.log_path}):\n{node.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise ClusterStartError(
                    f"storage {node.name} printed no READY line within "
                    f"{self.spec.start_timeout_s:.0f}s (log {node.log_path}):\n{node.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _stop_children(self) -> None:
        grace_s = self.spec.stop_timeout_s
        # Clients before servers, so nodes can unmount while the master is up.
        _terminate(self._nodes, signal.SIGTERM, grace_s)
        _terminate(self._masters, signal.SIGTERM, grace_s)
        _terminate(
            [c for c in (self._metadata, self._etcd) if c is not None], signal.SIGTERM, grace_s
        )
