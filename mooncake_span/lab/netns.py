"""A multi-host Mooncake topology on one Linux machine, built from network namespaces.

Every "host" is a network namespace with one interface (``mc0``) and one
address from ``198.18.0.0/24`` (RFC 2544 benchmarking space, never routed).
The hosts are joined by a bridge that itself lives in a namespace of its own,
so nothing is added to, or changed in, the machine's own network namespace::

    msp1a2b3c-br      bridge br0, one veth port per host (v-master, v-store1 ...)
    msp1a2b3c-master  mc0 198.18.0.1   mooncake_master (+ HTTP metadata, etcd)
    msp1a2b3c-store1  mc0 198.18.0.2   python -m mooncake_span.storage_node
    msp1a2b3c-store2  mc0 198.18.0.3   python -m mooncake_span.storage_node
    msp1a2b3c-prefill mc0 198.18.0.4   sglang prefill node (or node_worker)
    msp1a2b3c-decode  mc0 198.18.0.5   sglang decode node (or node_worker)

Namespace names carry a random run id, so concurrent runs never collide and
fixed ports are safe inside them (each namespace has its own port space).

Two layers:

* ``NetnsTopology``: the namespaces, ``partition(host)`` / ``heal(host)``
  (link down/up of the host's port on the bridge), and processes started in
  a host (``ip netns exec``) in their own session with logs in files. It is
  torn down by ``destroy()``, its context manager, and at interpreter exit.
* ``NetnsCluster``: the Mooncake side on a topology: optional etcd, one
  master (embedded HTTP metadata) or several HA masters (metadata in etcd),
  and storage nodes, each process bound to its host's address
  (``MC_TCP_BIND_ADDRESS``, ``--rpc_address`` ...).

Command line (``scripts/netns_cluster.sh`` wraps it)::

    python -m mooncake_span.lab.netns up [--ha] [--oplog] [--detach]
    python -m mooncake_span.lab.netns list
    python -m mooncake_span.lab.netns exec RUN_ID HOST -- COMMAND...
    python -m mooncake_span.lab.netns down RUN_ID | --stale

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2's ``ip``.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from mooncake_span.ops.cluster import find_executable
from mooncake_span.units import parse_size_bytes

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_HOSTS",
    "NetnsCluster",
    "NetnsClusterSpec",
    "NetnsProcess",
    "NetnsTopology",
    "NetnsUnavailableError",
    "TopologySpec",
    "netns_unavailable_reason",
]

DEFAULT_HOSTS = ("master", "store1", "store2", "prefill", "decode")
DEFAULT_SUBNET = "198.18.0.0/24"
DEFAULT_PREFIX = "msp"
# RFC 2544 benchmarking range; addresses from it can never clash with a real network.
_ALLOWED_SUPERNET = ipaddress.ip_network("198.18.0.0/15")
_BRIDGE_DEVICE = "br0"
_HOST_DEVICE = "mc0"
# Linux interface names are at most 15 bytes; "v-" + host name must fit.
_MAX_HOST_NAME_CHARS = 12
_HOST_NAME_RE = re.compile(r"^[a-z][a-z0-9]*$")
_PREFIX_RE = re.compile(r"^[a-z]{1,8}$")
_RUN_ID_RE = re.compile(r"^[0-9a-f]{6}$")
_NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_POLL_INTERVAL_S = 0.05
_IP_COMMAND_TIMEOUT_S = 10.0
_STATE_DIR_ENV = "MOONCAKE_SPAN_NETNS_STATE_DIR"

# Fixed ports inside the namespaces (each namespace has its own port space).
MASTER_RPC_PORT = 50051
MASTER_METRICS_PORT = 9003
HTTP_METADATA_PORT = 8080
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380

T = TypeVar("T")


class NetnsUnavailableError(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2 ...)."""


class NetnsCommandError(RuntimeError):
    """An ``ip`` command failed; the message carries its stderr."""


# ---------------------------------------------------------------------------
# low-level helpers


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *args]
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=_IP_COMMAND_TIMEOUT_S, check=False
    )
    if check and result.returncode != 0:
        raise NetnsCommandError(
            f"`{' '.join(argv)}` failed with exit code {result.returncode}: {result.stderr.strip()}"
        )
    return result


def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when a probe namespace worked."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not on PATH (apt-get install iproute2)"
    probe = f"{DEFAULT_PREFIX}{secrets.token_hex(3)}-probe"
    try:
        _ip("netns", "add", probe)
    except (NetnsCommandError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` does not work here: {exc}"
    try:
        _ip("-n", probe, "link", "add", _BRIDGE_DEVICE, "type", "bridge")
    except NetnsCommandError as exc:
        return f"cannot create a bridge inside a namespace: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def run_in_namespace(namespace: str, fn: Callable[[], T], timeout_s: float = 30.0) -> T:
    """Run ``fn`` in a short-lived thread that has entered ``namespace``.

    The network namespace is a per-thread attribute on Linux, so the thread's
    sockets live in that namespace while the rest of the process stays in its
    own. Used for probes (HTTP health checks, TCP connects) from the
    orchestrating process; ``fn`` must bound its own I/O.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            fd = os.open(_NETNS_DIR / namespace, os.O_RDONLY)
        except OSError as exc:
            outcome["error"] = NetnsCommandError(f"namespace {namespace!r} is not there: {exc}")
            return
        try:
            if _libc().setns(fd, _CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                outcome["error"] = NetnsCommandError(
                    f"setns({namespace}) failed: {os.strerror(errno)}"
                )
                return
        finally:
            os.close(fd)
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed back to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"call inside namespace {namespace} took more than {timeout_s:.0f}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _http_get(url: str, timeout_s: float) -> tuple[int, str] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None


def _process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            state = stat_file.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != b"Z"


def _namespace_pids(namespace: str) -> list[int]:
    result = _ip("netns", "pids", namespace, check=False)
    if result.returncode != 0:
        return []
    return [int(token) for token in result.stdout.split() if token.isdigit()]


def _kill_if_in_namespace(pid: int, namespace: str, sig: int) -> None:
    """Signal ``pid`` only while it still lives in ``namespace``.

    A pid listed a moment ago may have exited and been reused by a process
    elsewhere; the namespace inode check keeps the signal on our process.
    """
    try:
        if os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat(_NETNS_DIR / namespace).st_ino:
            return
        os.kill(pid, sig)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass


def _kill_namespace_processes(namespace: str, grace_s: float) -> list[int]:
    """SIGTERM, then SIGKILL, every process inside ``namespace``.

    Only used on namespaces this module created under a random run id, so
    every process in them was started by this run.
    """
    pids = [pid for pid in _namespace_pids(namespace) if pid != os.getpid()]
    for pid in pids:
        _kill_if_in_namespace(pid, namespace, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(_POLL_INTERVAL_S)
    for pid in pids:
        if _process_alive(pid):
            _kill_if_in_namespace(pid, namespace, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while any(_process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(_POLL_INTERVAL_S)
    return pids


def _state_dir() -> Path:
    configured = os.environ.get(_STATE_DIR_ENV)
    if configured:
        return Path(configured)
    run_dir = Path("/run")
    if os.access(run_dir, os.W_OK):
        return run_dir / "mooncake-span-netns"
    return Path(tempfile.gettempdir()) / "mooncake-span-netns"


# ---------------------------------------------------------------------------
# topology


@dataclass(frozen=True)
class TopologySpec:
    """Which hosts to create and how to name them. Validated on construction.

    ``hosts`` get addresses in order: the first host ``.1``, the next ``.2``...
    ``run_id`` defaults to 6 random hex digits; namespaces are named
    ``{prefix}{run_id}-{host}`` and ``{prefix}{run_id}-br`` for the bridge.
    """

    hosts: tuple[str, ...] = DEFAULT_HOSTS
    subnet: str = DEFAULT_SUBNET
    prefix: str = DEFAULT_PREFIX
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))

    def __post_init__(self) -> None:
        if isinstance(self.hosts, str) or not self.hosts:
            raise ValueError(
                f"TopologySpec.hosts={self.hosts!r} must be a non-empty tuple of names"
            )
        object.__setattr__(self, "hosts", tuple(self.hosts))
        for host in self.hosts:
            if (
                not isinstance(host, str)
                or not _HOST_NAME_RE.match(host)
                or len(host) > _MAX_HOST_NAME_CHARS
                or host == "br"
            ):
                raise ValueError(
                    f"host name {host!r}: use 1-{_MAX_HOST_NAME_CHARS} lowercase letters/digits, "
                    f"starting with a letter, and not 'br' (the bridge namespace)"
                )
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"TopologySpec.hosts={self.hosts!r} has duplicates")
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError(f"TopologySpec.prefix={self.prefix!r} must be 1-8 lowercase letters")
        if not _RUN_ID_RE.match(self.run_id):
            raise ValueError(f"TopologySpec.run_id={self.run_id!r} must be 6 lowercase hex digits")
        try:
            network = ipaddress.ip_network(self.subnet)
        except ValueError as exc:
            raise ValueError(f"TopologySpec.subnet={self.subnet!r}: {exc}") from None
        if network.version != 4 or not network.subnet_of(_ALLOWED_SUPERNET):  # type: ignore[arg-type]
            raise ValueError(
                f"TopologySpec.subnet={self.subnet!r} must lie inside {_ALLOWED_SUPERNET} "
                f"(benchmarking addresses that no real network uses)"
            )
        if network.num_addresses - 2 < len(self.hosts):
            raise ValueError(
                f"TopologySpec.subnet={self.subnet!r} has room for {network.num_addresses - 2} "
                f"hosts, {len(self.hosts)} requested"
            )

    @property
    def tag(self) -> str:
        return f"{self.prefix}{self.run_id}"

    @property
    def bridge_namespace(self) -> str:
        return f"{self.tag}-br"

    def namespace(self, host: str) -> str:
        self._check_host(host)
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        self._check_host(host)
        network = ipaddress.ip_network(self.subnet)
        return str(network.network_address + 1 + self.hosts.index(host))

    @property
    def prefix_length(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def bridge_port(self, host: str) -> str:
        """The host's veth end inside the bridge namespace."""
        self._check_host(host)
        return f"v-{host}"

    def namespaces(self) -> list[str]:
        return [self.bridge_namespace, *(self.namespace(h) for h in self.hosts)]

    def _check_host(self, host: str) -> None:
        if host not in self.hosts:
            raise KeyError(f"unknown host {host!r}; this topology has {list(self.hosts)}")


class NetnsProcess:
    """A process started inside a host namespace, in its own session.

    stdout goes to ``stdout_path`` and stderr to ``log_path`` (the same file
    unless the process was spawned with ``separate_stdout=True``).
    """

    def __init__(
        self,
        name: str,
        host: str,
        argv: list[str],
        popen: subprocess.Popen[bytes],
        log_path: Path,
        stdout_path: Path,
    ) -> None:
        self.name = name
        self.host = host
        self.argv = argv
        self.popen = popen
        self.log_path = log_path
        self.stdout_path = stdout_path
        self.started_at_s = time.time()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout_s: float) -> int | None:
        """Exit code, or None if still running after ``timeout_s``."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process group (the process and its children)."""
        if self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL. Returns the exit code."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            if self.wait(grace_s) is None:
                logger.warning(
                    "%s pid=%d ignored SIGTERM for %.1fs; SIGKILL", self.name, self.pid, grace_s
                )
                self.signal(signal.SIGKILL)
                self.wait(10.0)
        # No group signal after the leader is reaped: its group id could be
        # reused by then. Stray children are found by the topology's
        # per-namespace sweep at destroy().
        return self.popen.poll()

    def stdout_text(self) -> str:
        try:
            return self.stdout_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        tail = self.log_text().splitlines()[-lines:]
        return "\n".join(f"    {line[:300]}" for line in tail) or "    (empty)"


_LIVE_TOPOLOGIES: set[NetnsTopology] = set()


@atexit.register
def _destroy_live_topologies() -> None:
    for topology in list(_LIVE_TOPOLOGIES):
        topology.destroy()


class NetnsTopology:
    """Namespaces joined by a bridge namespace; see the module docstring.

    Use as a context manager or call ``create()`` / ``destroy()``. Not
    thread-safe for creation and destruction; ``spawn`` and the probes may be
    called from several threads.
    """

    def __init__(self, spec: TopologySpec | None = None, log_dir: str | Path | None = None):
        self.spec = spec if spec is not None else TopologySpec()
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._processes: list[NetnsProcess] = []
        self._lock = threading.Lock()
        self._created = False
        self._detached = False

    # -- lifecycle -------------------------------------------------------------

    def create(self) -> NetnsTopology:
        """Create every namespace, the bridge and the links.

        Raises:
            NetnsUnavailableError: not root, or no ``ip`` command.
            NetnsCommandError: an ``ip`` command failed; nothing is left behind.
        """
        if self._created:
            raise RuntimeError("NetnsTopology.create() called twice")
        if os.geteuid() != 0:
            raise NetnsUnavailableError("creating network namespaces needs root")
        if shutil.which("ip") is None:
            raise NetnsUnavailableError("iproute2's `ip` command is not on PATH")
        spec = self.spec
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix=f"{spec.tag}-logs-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._created = True
        _LIVE_TOPOLOGIES.add(self)
        try:
            self._write_state()
            bridge = spec.bridge_namespace
            _ip("netns", "add", bridge)
            _ip("-n", bridge, "link", "set", "lo", "up")
            _ip("-n", bridge, "link", "add", _BRIDGE_DEVICE, "type", "bridge")
            _ip("-n", bridge, "link", "set", _BRIDGE_DEVICE, "up")
            for host in spec.hosts:
                namespace = spec.namespace(host)
                port = spec.bridge_port(host)
                _ip("netns", "add", namespace)
                _ip("-n", namespace, "link", "set", "lo", "up")
                # Both veth ends are created inside namespaces: the bridge end
                # in the bridge namespace, the peer moved straight into the host.
                _ip(
                    "-n",
                    bridge,
                    "link",
                    "add",
                    port,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    _HOST_DEVICE,
                    "netns",
                    namespace,
                )
                _ip("-n", bridge, "link", "set", port, "master", _BRIDGE_DEVICE)
                _ip("-n", bridge, "link", "set", port, "up")
                _ip(
                    "-n",
                    namespace,
                    "addr",
                    "add",
                    f"{spec.address(host)}/{spec.prefix_length}",
                    "dev",
                    _HOST_DEVICE,
                )
                _ip("-n", namespace, "link", "set", _HOST_DEVICE, "up")
        except BaseException:
            self.destroy()
            raise
        logger.info(
            "netns topology %s up: %s (logs %s)",
            spec.tag,
            ", ".join(f"{h}={spec.address(h)}" for h in spec.hosts),
            self._log_dir,
        )
        return self

    def destroy(self, grace_s: float = 3.0) -> None:
        """Stop every process, then delete every namespace. Idempotent."""
        if not self._created:
            return
        try:
            with self._lock:
                processes = list(self._processes)
            for process in processes:
                process.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for process in processes:
                if process.wait(max(0.0, deadline - time.monotonic())) is None:
                    logger.warning(
                        "%s pid=%d still running at teardown; SIGKILL", process.name, process.pid
                    )
                process.stop(grace_s=0.5)
            for namespace in self.spec.namespaces():
                if (_NETNS_DIR / namespace).exists():
                    leftovers = _kill_namespace_processes(namespace, grace_s=1.0)
                    if leftovers:
                        logger.warning("killed leftover processes %s in %s", leftovers, namespace)
                    _ip("netns", "del", namespace, check=False)
        finally:
            self._created = False
            _LIVE_TOPOLOGIES.discard(self)
            self._remove_state()
        remaining = [n for n in self.spec.namespaces() if (_NETNS_DIR / n).exists()]
        if remaining:
            logger.error("namespaces could not be deleted: %s", remaining)
        else:
            logger.info("netns topology %s torn down", self.spec.tag)

    def detach(self) -> None:
        """Leave namespaces and processes running after this process exits.

        The state file keeps what ``python -m mooncake_span.lab.netns down RUN_ID``
        needs to tear it all down later.
        """
        self._detached = True
        self._write_state()
        _LIVE_TOPOLOGIES.discard(self)

    def __enter__(self) -> NetnsTopology:
        if not self._created:
            self.create()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.destroy()

    @property
    def created(self) -> bool:
        return self._created

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            raise RuntimeError("no log dir before create()")
        return self._log_dir

    # -- addressing ------------------------------------------------------------

    def address(self, host: str) -> str:
        return self.spec.address(host)

    def namespace(self, host: str) -> str:
        return self.spec.namespace(host)

    @property
    def hosts(self) -> tuple[str, ...]:
        return self.spec.hosts

    def host_env(self, host: str) -> dict[str, str]:
        """Environment a Mooncake client on ``host`` needs: bind and advertise its address."""
        address = self.address(host)
        return {"MC_TCP_BIND_ADDRESS": address, "MOONCAKE_LOCAL_HOSTNAME": address}

    # -- faults -------------------------------------------------------------------

    def partition(self, host: str) -> None:
        """Cut ``host`` off the bridge (its processes keep running)."""
        self._require_created()
        _ip("-n", self.spec.bridge_namespace, "link", "set", self.spec.bridge_port(host), "down")
        logger.info("partitioned %s (%s)", host, self.address(host))

    def heal(self, host: str) -> None:
        """Plug ``host`` back into the bridge."""
        self._require_created()
        _ip("-n", self.spec.bridge_namespace, "link", "set", self.spec.bridge_port(host), "up")
        logger.info("healed %s (%s)", host, self.address(host))

    # -- processes -----------------------------------------------------------------

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def spawn(
        self,
        host: str,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        separate_stdout: bool = False,
    ) -> NetnsProcess:
        """Start ``argv`` in ``host`` in a new session, logging to ``<log_dir>/<name>.log``.

        The child gets this process's environment, the host's Mooncake
        variables (``host_env``) and then ``env``.
        """
        self._require_created()
        if not re.match(r"^[A-Za-z0-9_.\-]+$", name):
            raise ValueError(f"process name {name!r} must be a plain file name")
        full_env = dict(os.environ)
        full_env.update(self.host_env(host))
        full_env["PYTHONUNBUFFERED"] = "1"
        if env:
            full_env.update(env)
        log_path = self.log_dir / f"{name}.log"
        stdout_path = self.log_dir / f"{name}.out" if separate_stdout else log_path
        full_argv = self.exec_argv(host, list(argv))
        with open(log_path, "ab") as log_file:
            log_file.write(f"=== {time.strftime('%H:%M:%S')} {host}: {' '.join(argv)}\n".encode())
            log_file.flush()
            stdout_file = open(stdout_path, "ab") if separate_stdout else log_file  # noqa: SIM115
            try:
                popen = subprocess.Popen(
                    full_argv,
                    stdin=subprocess.DEVNULL,
                    stdout=stdout_file,
                    stderr=log_file,
                    env=full_env,
                    start_new_session=True,
                    close_fds=True,
                )
            finally:
                if separate_stdout:
                    stdout_file.close()
        process = NetnsProcess(name, host, list(argv), popen, log_path, stdout_path)
        with self._lock:
            self._processes.append(process)
        logger.debug("spawned %s pid=%d in %s: %s", name, popen.pid, host, " ".join(argv))
        if self._detached:
            self._write_state()
        return process

    def processes(self) -> list[NetnsProcess]:
        with self._lock:
            return list(self._processes)

    # -- probes from this process ----------------------------------------------------

    def call_in(self, host: str, fn: Callable[[], T], timeout_s: float = 30.0) -> T:
        """Run ``fn`` in a thread inside ``host``'s namespace (see ``run_in_namespace``)."""
        self._require_created()
        return run_in_namespace(self.namespace(host), fn, timeout_s)

    def http_get(self, host: str, url: str, timeout_s: float = 2.0) -> tuple[int, str] | None:
        """GET ``url`` from inside ``host``; (status, body), or None when nothing answers."""
        return self.call_in(host, lambda: _http_get(url, timeout_s), timeout_s + 5.0)

    def can_connect(self, host: str, address: str, port: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connect from ``host`` to ``address:port`` succeeds within ``timeout_s``."""
        import socket

        def connect() -> bool:
            try:
                with socket.create_connection((address, port), timeout=timeout_s):
                    return True
            except OSError:
                return False

        return self.call_in(host, connect, timeout_s + 5.0)

    # -- state file (for `down` after a crash or a detached `up`) ---------------------

    @property
    def state_path(self) -> Path:
        return _state_dir() / f"{self.spec.tag}.json"

    def _write_state(self, extra: Mapping[str, Any] | None = None) -> None:
        path = self.state_path
        path.parent.mkdir(parents=True, exist_ok=True)
        previous: dict[str, Any] = {}
        if path.exists():
            try:
                previous = json.loads(path.read_text())
            except ValueError:
                previous = {}
        state = {
            **previous,
            "run_id": self.spec.run_id,
            "tag": self.spec.tag,
            "namespaces": self.spec.namespaces(),
            "hosts": {h: self.spec.address(h) for h in self.spec.hosts},
            "owner_pid": os.getpid(),
            "detached": self._detached,
            "log_dir": str(self._log_dir),
            "processes": [{"name": p.name, "host": p.host, "pid": p.pid} for p in self.processes()],
            **(extra or {}),
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(path)

    def record(self, **extra: Any) -> None:
        """Add ``extra`` (e.g. cluster addresses) to the state file."""
        self._write_state(extra)

    def _remove_state(self) -> None:
        try:
            self.state_path.unlink()
        except FileNotFoundError:
            pass

    def _require_created(self) -> None:
        if not self._created:
            raise RuntimeError("the topology is not created; call create() first")


# ---------------------------------------------------------------------------
# Mooncake on a topology


@dataclass(frozen=True)
class NetnsClusterSpec:
    """Where the Mooncake processes run. Validated on construction.

    One master runs with the embedded HTTP metadata server. Two or more
    ``master_hosts`` run in etcd HA mode (``etcd_host`` required); the
    metadata then lives in etcd as well, so a failover does not lose it.
    ``port_offset`` shifts every port, so two clusters can share hosts.
    """

    master_hosts: tuple[str, ...] = ("master",)
    storage_hosts: tuple[str, ...] = ("store1", "store2")
    etcd_host: str | None = None
    enable_oplog: bool = False
    segment_bytes: int = 256 << 20
    local_buffer_bytes: int = 16 << 20
    client_ttl_s: int | None = None
    port_offset: int = 0
    start_timeout_s: float = 60.0
    stop_grace_s: float = 3.0

    def __post_init__(self) -> None:
        for name in ("master_hosts", "storage_hosts"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"NetnsClusterSpec.{name}={value!r} must be a tuple of host names")
            object.__setattr__(self, name, tuple(value))
        if not self.master_hosts:
            raise ValueError("NetnsClusterSpec.master_hosts must name at least one host")
        if len(self.master_hosts) > 1 and self.etcd_host is None:
            raise ValueError(
                f"{len(self.master_hosts)} masters run in HA mode, which needs etcd; set etcd_host"
            )
        if self.enable_oplog and len(self.master_hosts) < 2:
            raise ValueError(
                "enable_oplog replicates metadata between HA masters; name >= 2 master_hosts"
            )
        for name in ("segment_bytes", "local_buffer_bytes"):
            try:
                object.__setattr__(self, name, parse_size_bytes(getattr(self, name)))
            except ValueError as exc:
                raise ValueError(f"NetnsClusterSpec.{name}: {exc}") from None
        if self.storage_hosts and self.segment_bytes <= 0:
            raise ValueError(
                "NetnsClusterSpec.segment_bytes must be > 0 when storage_hosts are given"
            )
        if self.client_ttl_s is not None and (
            isinstance(self.client_ttl_s, bool)
            or not isinstance(self.client_ttl_s, int)
            or self.client_ttl_s < 1
        ):
            raise ValueError(
                f"NetnsClusterSpec.client_ttl_s={self.client_ttl_s!r} must be an int >= 1"
            )
        if (
            isinstance(self.port_offset, bool)
            or not isinstance(self.port_offset, int)
            or not 0 <= self.port_offset <= 1000
        ):
            raise ValueError(
                f"NetnsClusterSpec.port_offset={self.port_offset!r} must be an int in 0..1000"
            )
        for name in ("start_timeout_s", "stop_grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"NetnsClusterSpec.{name}={value!r} must be a positive number")

    @property
    def ha(self) -> bool:
        return len(self.master_hosts) > 1

    def hosts_used(self) -> set[str]:
        used = set(self.master_hosts) | set(self.storage_hosts)
        if self.etcd_host is not None:
            used.add(self.etcd_host)
        return used


class ClusterStartError(RuntimeError):
    """A Mooncake process did not become ready; the message carries its log tail."""


class NetnsCluster:
    """etcd, masters and storage nodes on a ``NetnsTopology``.

    Every process is bound to its host's address. ``stop()`` stops them in
    reverse order; the topology's ``destroy()`` would stop them as well.
    """

    def __init__(
        self, topology: NetnsTopology, spec: NetnsClusterSpec | None = None, name: str = "mc"
    ):
        self.topology = topology
        self.spec = spec if spec is not None else NetnsClusterSpec()
        missing = self.spec.hosts_used() - set(topology.hosts)
        if missing:
            raise ValueError(f"cluster spec names hosts {sorted(missing)} that the topology lacks")
        if not re.match(r"^[a-z0-9]+$", name):
            raise ValueError(f"cluster name {name!r} must be lowercase letters/digits")
        self.name = name
        self.etcd: NetnsProcess | None = None
        self.masters: list[NetnsProcess | None] = [None] * len(self.spec.master_hosts)
        self.storage_nodes: list[NetnsProcess] = []
        self._started = False

    # -- addresses ----------------------------------------------------------------

    def _port(self, base: int, index: int = 0) -> int:
        # Masters sharing a host need distinct ports; on distinct hosts the
        # index shift is harmless.
        return base + self.spec.port_offset + index

    def master_rpc(self, i: int = 0) -> str:
        return (
            f"{self.topology.address(self.spec.master_hosts[i])}:{self._port(MASTER_RPC_PORT, i)}"
        )

    def metrics_url(self, i: int = 0) -> str:
        host = self.topology.address(self.spec.master_hosts[i])
        return f"http://{host}:{self._port(MASTER_METRICS_PORT, i)}"

    @property
    def etcd_endpoint(self) -> str | None:
        """``HOST:PORT`` of etcd's client URL, None without etcd."""
        if self.spec.etcd_host is None:
            return None
        return f"{self.topology.address(self.spec.etcd_host)}:{self._port(ETCD_CLIENT_PORT)}"

    @property
    def master_address(self) -> str:
        if self.spec.ha:
            return f"etcd://{self.etcd_endpoint}"
        return self.master_rpc(0)

    @property
    def metadata_server(self) -> str:
        if self.spec.ha:
            return f"etcd://{self.etcd_endpoint}"
        host = self.topology.address(self.spec.master_hosts[0])
        return f"http://{host}:{self._port(HTTP_METADATA_PORT)}/metadata"

    def client_config(self, host: str, global_segment_size_bytes: int = 0) -> dict[str, object]:
        """sglang extra-config keys for a client on ``host``."""
        return {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "protocol": "tcp",
            "local_hostname": self.topology.address(host),
            "global_segment_size": int(global_segment_size_bytes),
        }

    def describe(self) -> dict[str, object]:
        return {
            "master_address": self.master_address,
            "metadata_server": self.metadata_server,
            "etcd_endpoint": self.etcd_endpoint,
            "masters": [self.master_rpc(i) for i in range(len(self.spec.master_hosts))],
            "metrics": [self.metrics_url(i) for i in range(len(self.spec.master_hosts))],
            "storage_hosts": {h: self.topology.address(h) for h in self.spec.storage_hosts},
            "ha": self.spec.ha,
            "enable_oplog": self.spec.enable_oplog,
        }

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> NetnsCluster:
        """Start etcd, masters and storage nodes; return when all are ready.

        Raises:
            ClusterStartError: a process died or missed ``spec.start_timeout_s``;
                everything this call started is stopped again.
        """
        if self._started:
            raise RuntimeError("NetnsCluster.start() called twice")
        self._started = True
        deadline = time.monotonic() + self.spec.start_timeout_s
        try:
            if self.spec.etcd_host is not None:
                self._start_etcd(deadline)
            self.masters[0] = self._spawn_master(0)
            # Master 0 alone first, so in HA mode it is deterministically the first leader.
            self._wait_master(0, deadline, serving=True)
            for i in range(1, len(self.spec.master_hosts)):
                self.masters[i] = self._spawn_master(i)
            for i in range(1, len(self.spec.master_hosts)):
                self._wait_master(i, deadline, serving=False)
            self.storage_nodes = [
                self._spawn_storage_node(i) for i in range(len(self.spec.storage_hosts))
            ]
            for node in self.storage_nodes:
                self._wait_ready_line(node, deadline)
        except BaseException:
            self.stop()
            raise
        logger.info("mooncake on netns up: %s", json.dumps(self.describe()))
        return self

    def stop(self) -> None:
        """Stop storage nodes, masters and etcd (SIGTERM, then SIGKILL). Idempotent."""
        grace_s = self.spec.stop_grace_s
        for node in self.storage_nodes:
            node.signal(signal.SIGTERM)
        for node in self.storage_nodes:
            node.stop(grace_s)
        for master in self.masters:
            if master is not None:
                master.stop(grace_s)
        if self.etcd is not None:
            self.etcd.stop(grace_s)
        self._started = False

    def __enter__(self) -> NetnsCluster:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- observation ----------------------------------------------------------------

    def health(self, i: int) -> dict[str, Any] | None:
        """Master i's ``/health`` JSON (role, service_ready ...), None if it does not answer."""
        answer = self.topology.http_get(self.spec.master_hosts[i], self.metrics_url(i) + "/health")
        if answer is None or answer[0] != 200:
            return None
        try:
            parsed = json.loads(answer[1])
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None

    def summary(self, i: int = 0) -> str | None:
        """Master i's ``/metrics/summary`` text, None if it does not answer."""
        answer = self.topology.http_get(
            self.spec.master_hosts[i], self.metrics_url(i) + "/metrics/summary"
        )
        return None if answer is None or answer[0] != 200 else answer[1]

    def leader_index(self) -> int | None:
        """Index of the running master that reports itself a serving leader."""
        for i, master in enumerate(self.masters):
            if master is None or not master.running():
                continue
            health = self.health(i)
            if health and health.get("role") == "leader" and health.get("service_ready") is True:
                return i
        return None

    def wait_for_leader(self, timeout_s: float = 30.0) -> int:
        """Wait until some master is a serving leader; return its index."""
        deadline = time.monotonic() + timeout_s
        while True:
            leader = self.leader_index()
            if leader is not None:
                return leader
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no master became a serving leader within {timeout_s:.0f}s")
            time.sleep(_POLL_INTERVAL_S * 4)

    # -- faults -----------------------------------------------------------------------

    def kill_master(self, i: int, sig: int = signal.SIGKILL) -> None:
        master = self.masters[i]
        if master is None:
            raise RuntimeError(f"master {i} was never started")
        master.signal(sig)
        if master.wait(10.0) is None:
            master.stop(0.5)

    def restart_master(self, i: int, timeout_s: float | None = None) -> None:
        """Start master i again (after a kill); returns once it answers /health."""
        master = self.masters[i]
        if master is not None and master.running():
            master.stop(self.spec.stop_grace_s)
        self.masters[i] = self._spawn_master(i)
        deadline = time.monotonic() + (timeout_s or self.spec.start_timeout_s)
        self._wait_master(i, deadline, serving=not self.spec.ha)

    def kill_storage_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        node = self.storage_nodes[i]
        node.signal(sig)
        if node.wait(10.0) is None:
            node.stop(0.5)

    # -- internals ----------------------------------------------------------------------

    def _start_etcd(self, deadline: float) -> None:
        host = self.spec.etcd_host
        assert host is not None  # checked by the caller
        address = self.topology.address(host)
        data_dir = self.topology.log_dir / f"{self.name}-etcd-data"
        shutil.rmtree(data_dir, ignore_errors=True)
        client_url = f"http://{address}:{self._port(ETCD_CLIENT_PORT)}"
        peer_url = f"http://{address}:{self._port(ETCD_PEER_PORT)}"
        member = f"{self.name}-etcd"
        self.etcd = self.topology.spawn(
            host,
            f"{self.name}-etcd",
            [
                find_executable("etcd"),
                f"--name={member}",
                f"--data-dir={data_dir}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster={member}={peer_url}",
                "--initial-cluster-state=new",
            ],
        )
        self._wait_http(
            self.etcd,
            host,
            client_url + "/health",
            deadline,
            lambda s, b: s == 200 and '"true"' in b,
        )

    def _master_argv(self, i: int) -> list[str]:
        spec = self.spec
        address = self.topology.address(spec.master_hosts[i])
        argv = [
            find_executable("mooncake_master"),
            f"--rpc_port={self._port(MASTER_RPC_PORT, i)}",
            f"--rpc_address={address}",
            f"--metrics_port={self._port(MASTER_METRICS_PORT, i)}",
            f"--metrics_host={address}",
            "--logtostderr",
        ]
        if spec.ha:
            argv += [
                "--enable_ha=true",
                "--ha_backend_type=etcd",
                f"--ha_backend_connstring={self.etcd_endpoint}",
            ]
            if spec.enable_oplog:
                argv.append("--enable_oplog=true")
        else:
            argv += [
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={self._port(HTTP_METADATA_PORT)}",
                f"--http_metadata_server_host={address}",
            ]
        if spec.client_ttl_s is not None:
            argv.append(f"--client_ttl={spec.client_ttl_s}")
        return argv

    def _spawn_master(self, i: int) -> NetnsProcess:
        return self.topology.spawn(
            self.spec.master_hosts[i], f"{self.name}-master{i}", self._master_argv(i)
        )

    def _spawn_storage_node(self, i: int) -> NetnsProcess:
        host = self.spec.storage_hosts[i]
        argv = [
            sys.executable,
            "-m",
            "mooncake_span.storage_node",
            f"--master={self.master_address}",
            f"--metadata={self.metadata_server}",
            f"--segment-bytes={self.spec.segment_bytes}",
            f"--local-buffer-bytes={self.spec.local_buffer_bytes}",
            f"--host={self.topology.address(host)}",
        ]
        return self.topology.spawn(host, f"{self.name}-node{i}-{host}", argv)

    def _wait_http(
        self,
        process: NetnsProcess,
        host: str,
        url: str,
        deadline: float,
        accept: Callable[[int, str], bool],
    ) -> None:
        last: tuple[int, str] | None = None
        while True:
            if not process.running():
                raise ClusterStartError(
                    f"{process.name} exited with code {process.returncode} while starting "
                    f"(log {process.log_path}):\n{process.log_tail()}"
                )
            last = self.topology.http_get(host, url, timeout_s=1.0)
            if last is not None and accept(*last):
                return
            if time.monotonic() >= deadline:
                raise ClusterStartError(
                    f"{process.name} did not answer {url} in time (last {last!r}; "
                    f"log {process.log_path}):\n{process.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _wait_master(self, i: int, deadline: float, *, serving: bool) -> None:
        master = self.masters[i]
        assert master is not None  # spawned by the caller
        host = self.spec.master_hosts[i]

        def accept(status: int, body: str) -> bool:
            if status != 200:
                return False
            try:
                health = json.loads(body)
            except ValueError:
                return False
            # /health answers before the RPC port is bound; service_ready says it serves.
            return not serving or (isinstance(health, dict) and health.get("service_ready") is True)

        self._wait_http(master, host, self.metrics_url(i) + "/health", deadline, accept)

    def _wait_ready_line(self, process: NetnsProcess, deadline: float) -> None:
        while True:
            if any(line.startswith("READY ") for line in process.log_text().splitlines()):
                return
            if not process.running():
                raise ClusterStartError(
                    f"{process.name} exited with code {process.returncode} before READY "
                    f"(log {process.log_path}):\n{process.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise ClusterStartError(
                    f"{process.name} printed no READY line in time (log {process.log_path}):\n"
                    f"{process.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)


# ---------------------------------------------------------------------------
# command line


def _load_states() -> list[dict[str, Any]]:
    directory = _state_dir()
    states = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        state["_path"] = str(path)
        states.append(state)
    return states


def _find_state(run_id: str) -> dict[str, Any]:
    for state in _load_states():
        if run_id in (state.get("run_id"), state.get("tag")):
            return state
    raise SystemExit(f"no netns run {run_id!r} in {_state_dir()}; see `list`")


def _teardown_state(state: Mapping[str, Any]) -> None:
    for namespace in state.get("namespaces", []):
        if (_NETNS_DIR / namespace).exists():
            killed = _kill_namespace_processes(namespace, grace_s=3.0)
            if killed:
                print(f"{namespace}: stopped pids {killed}")
            _ip("netns", "del", namespace, check=False)
            print(f"deleted namespace {namespace}")
    path = state.get("_path")
    if path:
        Path(path).unlink(missing_ok=True)


def _cmd_up(args: argparse.Namespace) -> int:
    hosts = list(DEFAULT_HOSTS)
    if args.ha:
        hosts.insert(1, "master2")
    spec = TopologySpec(hosts=tuple(hosts))
    topology = NetnsTopology(spec, log_dir=args.log_dir)
    cluster_spec = NetnsClusterSpec(
        master_hosts=("master", "master2") if args.ha else ("master",),
        storage_hosts=("store1", "store2"),
        etcd_host="master" if (args.ha or not args.no_etcd) else None,
        enable_oplog=args.oplog,
        segment_bytes=args.segment_size,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        topology.create()
        cluster = NetnsCluster(topology, cluster_spec).start()
        topology.record(cluster=cluster.describe())
        run_id = spec.run_id
        config_file = "ha-etcd.json" if args.ha else "prefill-decode.json"
        # the node worker is test support: run it from a checkout of this repository
        worker = "env PYTHONPATH=. python -m tests.netns.node_worker"
        lines = [
            f"netns topology {spec.tag} is up (logs {topology.log_dir})",
            *(
                f"  {h:8s} {topology.address(h):14s} namespace {topology.namespace(h)}"
                for h in spec.hosts
            ),
            "",
            *(f"  {key}: {value}" for key, value in cluster.describe().items()),
            "",
            f"# sglang extra-config on the prefill host (merge with configs/{config_file}):",
            "  " + json.dumps(cluster.client_config("prefill")),
            "",
            "# run a command on a host (binds MC_TCP_BIND_ADDRESS to its address):",
            f"  python -m mooncake_span.lab.netns exec {run_id} prefill -- {worker} write "
            f"--master {cluster.master_address} --metadata {cluster.metadata_server}",
            f"  python -m mooncake_span.lab.netns exec {run_id} decode -- {worker} read "
            f"--master {cluster.master_address} --metadata {cluster.metadata_server}",
            "",
        ]
        if args.detach:
            topology.detach()
            lines.append(
                f"detached; tear down with: python -m mooncake_span.lab.netns down {run_id}"
            )
            print("\n".join(lines), flush=True)
            return 0
        lines.append("ready; Ctrl-C tears everything down")
        print("\n".join(lines), flush=True)
        while not stop.wait(1.0):
            for process in topology.processes():
                if not process.running():
                    print(
                        f"warning: {process.name} exited ({process.returncode}); "
                        f"log {process.log_path}",
                        file=sys.stderr,
                    )
                    stop.set()
        return 0
    except (NetnsUnavailableError, NetnsCommandError, ClusterStartError, FileNotFoundError) as exc:
        print(f"netns up: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # A detached run left _LIVE_TOPOLOGIES; anything else is torn down here.
        if topology in _LIVE_TOPOLOGIES:
            topology.destroy()


def _cmd_down(args: argparse.Namespace) -> int:
    if args.stale:
        for state in _load_states():
            owner = int(state.get("owner_pid", 0))
            if state.get("detached") or (owner and _process_alive(owner)):
                continue
            print(f"tearing down stale run {state.get('tag')} (owner pid {owner} is gone)")
            _teardown_state(state)
        return 0
    if not args.run_id:
        raise SystemExit("down: name a RUN_ID (see `list`) or pass --stale")
    _teardown_state(_find_state(args.run_id))
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    states = _load_states()
    if not states:
        print(f"no netns runs recorded in {_state_dir()}")
    for state in states:
        owner = int(state.get("owner_pid", 0))
        alive = (
            "detached"
            if state.get("detached")
            else ("running" if _process_alive(owner) else "stale")
        )
        print(
            f"{state.get('run_id')}  {alive:8s}  hosts {json.dumps(state.get('hosts'))}  "
            f"logs {state.get('log_dir')}"
        )
        cluster = state.get("cluster")
        if cluster:
            print(
                f"        master {cluster.get('master_address')}  "
                f"metadata {cluster.get('metadata_server')}"
            )
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    state = _find_state(args.run_id)
    hosts = state.get("hosts", {})
    if args.host not in hosts:
        raise SystemExit(f"exec: run {args.run_id} has hosts {sorted(hosts)}, not {args.host!r}")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("exec: give a command after --")
    namespace = f"{state['tag']}-{args.host}"
    address = hosts[args.host]
    os.execvp(
        "ip",
        [
            "ip",
            "netns",
            "exec",
            namespace,
            "env",
            f"MC_TCP_BIND_ADDRESS={address}",
            f"MOONCAKE_LOCAL_HOSTNAME={address}",
            *command,
        ],
    )
    return 127  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mooncake_span.lab.netns",
        description=(
            "A multi-host Mooncake topology on one machine: network namespaces (master, "
            "store1, store2, prefill, decode; master2 with --ha) joined by a bridge that lives "
            "in its own namespace, addresses 198.18.0.x/24. Needs root and iproute2."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = commands.add_parser("up", help="create the topology and start Mooncake on it")
    up.add_argument(
        "--ha", action="store_true", help="two masters (master, master2) in etcd HA mode"
    )
    up.add_argument(
        "--oplog", action="store_true", help="with --ha: replicate metadata (--enable_oplog=true)"
    )
    up.add_argument(
        "--no-etcd",
        action="store_true",
        help="without --ha: skip the etcd on the master host (used by span_layout_guard=etcd)",
    )
    up.add_argument("--segment-size", default="1gb", help="memory per storage node (default 1gb)")
    up.add_argument(
        "--log-dir", default=None, help="directory for process logs (default: a temp dir)"
    )
    up.add_argument(
        "--detach",
        action="store_true",
        help="exit after start-up and leave everything running (tear down with `down RUN_ID`)",
    )
    up.set_defaults(func=_cmd_up)
    down = commands.add_parser("down", help="tear a run down (its processes and namespaces)")
    down.add_argument("run_id", nargs="?", help="run id (from `list` or the `up` output)")
    down.add_argument(
        "--stale", action="store_true", help="tear down every run whose owner process died"
    )
    down.set_defaults(func=_cmd_down)
    listing = commands.add_parser("list", help="show recorded runs")
    listing.set_defaults(func=_cmd_list)
    execute = commands.add_parser("exec", help="run a command on a host of a run")
    execute.add_argument("run_id")
    execute.add_argument("host")
    execute.add_argument("command", nargs=argparse.REMAINDER)
    execute.set_defaults(func=_cmd_exec)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "up" and args.oplog and not args.ha:
        print("netns up: --oplog needs --ha", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
