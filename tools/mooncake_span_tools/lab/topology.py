"""Network namespaces joined by a bridge namespace, and processes started inside them.

See :mod:`mooncake_span_tools.lab.netns` for the picture. ``NetnsTopology`` creates
the namespaces, cuts and heals a host's link (``partition`` / ``heal``), starts
processes in a host (``ip netns exec``) in their own session with logs in
files, and is torn down by ``destroy()``, its context manager, and at
interpreter exit.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_span.ops.launcher import http_get, popen_tied, read_text_from
from mooncake_span_tools.lab.namespaces import (
    _ALLOWED_SUPERNET,
    _BRIDGE_DEVICE,
    _HOST_DEVICE,
    _HOST_NAME_RE,
    _MAX_HOST_NAME_CHARS,
    _NETNS_DIR,
    _PREFIX_RE,
    _RUN_ID_RE,
    DEFAULT_HOSTS,
    DEFAULT_PREFIX,
    DEFAULT_SUBNET,
    NetnsUnavailableError,
    T,
    _ip,
    _kill_namespace_processes,
    _state_dir,
    run_in_namespace,
)

logger = logging.getLogger(__name__)


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
        stdout_offset: int = 0,
    ) -> None:
        self.name = name
        self.host = host
        self.argv = argv
        self.popen = popen
        self.log_path = log_path
        self.stdout_path = stdout_path
        # Where this run's output starts in a file earlier runs may have written.
        self.stdout_offset = stdout_offset
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

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def output_text(self) -> str:
        """What this run printed to stdout (not earlier runs logging to the same file)."""
        return read_text_from(self.stdout_path, self.stdout_offset)

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

    def __init__(
        self,
        spec: TopologySpec | None = None,
        log_dir: str | Path | None = None,
        *,
        outlive_owner: bool = False,
    ):
        self.spec = spec if spec is not None else TopologySpec()
        self._log_dir = Path(log_dir) if log_dir is not None else None
        # Spawned processes die with this process unless the topology is to be
        # detached (``netns up --detach``); its namespaces then stay for ``down``.
        self._outlive_owner = outlive_owner
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

        The state file keeps what ``python -m mooncake_span_tools.lab.netns down RUN_ID``
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
            stdout_offset = stdout_file.tell()
            try:
                popen = (subprocess.Popen if self._outlive_owner else popen_tied)(
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
        process = NetnsProcess(name, host, list(argv), popen, log_path, stdout_path, stdout_offset)
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
        return self.call_in(host, lambda: http_get(url, timeout_s), timeout_s + 5.0)

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
