"""Start and stop a local Mooncake cluster from Python (tests, demos, benches).

Child processes on one host (docs/operating.md, "A local cluster", says what runs
and where). Standard library and the Mooncake executables only, never
``mooncake``. Not thread-safe: drive one ``LocalCluster`` from one thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mooncake_span.errors import ConfigError
from mooncake_span.mooncake_settings import validate_master_address, validate_metadata_server
from mooncake_span.ops import launcher as L
from mooncake_span.ops.cluster_spec import ClusterSpec, ExternalCluster, sglang_client_config
from mooncake_span.ops.launcher import ClusterStartError, find_executable
from mooncake_span.store.ssd_tier import (
    DirLock,
    check_room,
    check_root,
    default_cap_bytes,
    held_bytes,
    usable_bytes,
)

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


@dataclass(frozen=True)
class _Ports:
    master_rpc: tuple[int, ...]
    master_metrics: tuple[int, ...]
    metadata_http: int | None
    etcd_client: int | None
    etcd_peer: int | None


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
        self._etcd: L.LocalProcess | None = None
        self._metadata: L.LocalProcess | None = None
        self._masters: list[L.LocalProcess] = []
        self._nodes: list[L.LocalProcess] = []
        self._started = False

    def start(self) -> LocalCluster:
        """Start everything; return once masters serve and storage nodes are READY.

        Raises:
            FileNotFoundError: an executable is missing.
            ClusterStartError: a component died or missed ``spec.start_timeout_s``;
                the message includes its log tail. Nothing is left running. Also
                a bad ``spec.ssd_dir``, before anything starts.
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
        if spec.ssd_dir is not None:
            try:
                root = check_root(str(spec.ssd_dir), "--ssd-dir")
                self._check_disk_room(root)
                for i in range(spec.storage_nodes):
                    DirLock(root, f"node{i}").check_free(f"{root}/node{i}")
            except ConfigError as exc:
                raise ClusterStartError(str(exc)) from None
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
                except L.EarlyExitError as exc:
                    if attempt == _START_ATTEMPTS:
                        raise
                    logger.warning(
                        "cluster start attempt %d/%d failed, retrying on fresh ports: %s",
                        attempt,
                        _START_ATTEMPTS,
                        str(exc).splitlines()[0],
                    )
                    self._stop_children()
            site = self._site()
            self._nodes = [
                site.start(f"node{i}", self._node_argv(f"node{i}"))
                for i in range(spec.storage_nodes)
            ]
            for node in self._nodes:
                L.wait_ready_line(node, deadline)
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

    def _check_disk_room(self, root: str) -> None:
        """The nodes share the disk of ``root``: ConfigError when it cannot hold one
        object, a warning when their caps exceed it (docs/operating.md, "The SSD tier")."""
        spec = self.spec
        if usable_bytes(root) >= spec.storage_node_segment_bytes:
            return
        held = sum(held_bytes(f"{root}/node{i}") for i in range(spec.storage_nodes))
        cap = spec.ssd_size_bytes if spec.ssd_size_bytes is not None else default_cap_bytes(root)
        short = check_room(
            usable_bytes(root, held),
            cap * spec.storage_nodes,
            spec.storage_node_segment_bytes,
            f"--ssd-dir {root}",
            f"--ssd-size x {spec.storage_nodes} node(s)",
        )
        if short:
            logger.warning("%s", short)

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
        # With HA masters the leader moves; the default admin URL rule applies then.
        # No span_object_checksums: with an SSD tier clients seal by default
        # (store/ssd_marker.py).
        admin_url = None if self.spec.ha_masters > 1 else self.metrics_url
        return sglang_client_config(
            self.master_address,
            self.metadata_server,
            self.spec.host,
            global_segment_size_bytes,
            admin_url,
        )

    def client_env(self) -> dict[str, str]:
        return {"MC_TCP_BIND_ADDRESS": self.spec.host, **self.spec.env_overrides}

    def pids(self) -> dict[str, int]:
        """PIDs of the processes that are currently running, by name (``master0``, ``node1``...)."""
        children = [self._etcd, self._metadata, *self._masters, *self._nodes]
        return {
            child.name: child.popen.pid
            for child in children
            if child is not None and child.popen is not None and child.running()
        }

    def summary(self, i: int = 0) -> str:
        """Master i's ``/metrics/summary`` text (role, state, memory, keys, clients).

        Raises:
            ConnectionError: the master does not answer.
        """
        url = self.master_metrics_url(i) + "/metrics/summary"
        answer = L.http_get(url, timeout_s=2.0)
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

        def healths() -> list[dict[str, object] | None]:
            return [
                L.parse_health(L.http_get(self.master_metrics_url(i) + "/health"))
                if master.running()
                else None
                for i, master in enumerate(self._masters)
            ]

        return L.wait_for_leader(healths, timeout_s)

    def kill_storage_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to storage node i's process group and wait for it to exit."""
        node = self._nodes[self._node_index(i)]
        L.terminate([node], sig, self.spec.stop_timeout_s)

    def restart_storage_node(self, i: int) -> None:
        """(Re)start storage node i and wait for READY; a running node is stopped first."""
        node = self._nodes[self._node_index(i)]
        self._restart(node, lambda deadline: L.wait_ready_line(node, deadline))

    def kill_master(self, i: int = 0, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to master i's process group and wait for it to exit."""
        master = self._masters[self._master_index(i)]
        L.terminate([master], sig, self.spec.stop_timeout_s)

    def restart_master(self, i: int = 0) -> None:
        """(Re)start master i on its old ports; return once it serves, or with HA masters
        once it answers ``/health`` (it may come back a standby). A non-HA master
        restarts empty; the storage nodes re-register their segments by themselves."""
        master = self._masters[self._master_index(i)]
        url, serving = self.master_metrics_url(i), not self.spec.ha
        self._restart(
            master, lambda end: L.wait_master(master, self._site(), url, end, serving=serving)
        )

    def _restart(self, process: L.LocalProcess, wait: Callable[[float], None]) -> None:
        if process.running():
            L.terminate([process], signal.SIGTERM, self.spec.stop_timeout_s)
        process.start()
        try:
            wait(time.monotonic() + self.spec.start_timeout_s)
        except BaseException:
            L.terminate([process], signal.SIGKILL, self.spec.stop_timeout_s)
            raise

    def _require_ports(self) -> _Ports:
        if self._ports is None or not self._started:
            raise RuntimeError("LocalCluster is not running; call start() first")
        return self._ports

    def _master_index(self, i: int) -> int:
        return self._index(i, self.spec.ha_masters, "master", "ha_masters")

    def _node_index(self, i: int) -> int:
        return self._index(i, len(self._nodes), "storage node", "storage_nodes")

    def _index(self, i: int, count: int, what: str, field: str) -> int:
        self._require_ports()
        if not 0 <= i < count:
            raise IndexError(f"{what} index {i} out of range ({field}={getattr(self.spec, field)})")
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
        ports = iter(L.pick_free_ports(spec.host, count))
        rpc = tuple(next(ports) for _ in range(spec.ha_masters))
        metrics = tuple(next(ports) for _ in range(spec.ha_masters))
        metadata_http = next(ports) if need_http else None
        etcd_client = next(ports) if spec.etcd else None
        etcd_peer = next(ports) if spec.etcd else None
        return _Ports(rpc, metrics, metadata_http, etcd_client, etcd_peer)

    def _site(self) -> L.LocalSite:
        # Children print through Python's stdout; unbuffered so READY lands at once.
        env = {**os.environ, **self.client_env(), "PYTHONUNBUFFERED": "1"}
        return L.LocalSite(self.log_dir, env)

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
        site = self._site()
        host = spec.host
        if etcd_bin is not None:
            data_dir = self.log_dir / f"etcd-data-{attempt}"
            shutil.rmtree(data_dir, ignore_errors=True)
            argv = L.etcd_argv(
                etcd_bin,
                member="mooncake-span",
                data_dir=data_dir,
                host=host,
                client_port=ports.etcd_client,
                peer_port=ports.etcd_peer,
            )
            self._etcd = site.start("etcd", argv)
            url = f"http://{host}:{ports.etcd_client}/health"
            L.wait_http(self._etcd, site, url, deadline, L.etcd_healthy)
        if metadata_bin is not None:
            argv = [metadata_bin, f"--port={ports.metadata_http}", f"--host={host}"]
            self._metadata = site.start("metadata", argv)
            url = f"http://{host}:{ports.metadata_http}/metadata?key=mooncake-span-probe"
            L.wait_http(self._metadata, site, url, deadline, lambda status, body: True)
        self._masters = []
        L.start_masters(
            lambda i: site,
            [f"master{i}" for i in range(spec.ha_masters)],
            [self._master_args(i).argv(master_bin) for i in range(spec.ha_masters)],
            [self.master_metrics_url(i) for i in range(spec.ha_masters)],
            deadline,
            lambda i, process: self._masters.append(process),
        )

    def _master_args(self, i: int) -> L.MasterArgs:
        spec = self.spec
        ports = self._require_ports()
        return L.MasterArgs(
            host=spec.host,
            rpc_port=ports.master_rpc[i],
            metrics_port=ports.master_metrics[i],
            http_metadata_port=ports.metadata_http if spec.metadata_mode == "embedded" else None,
            ha_etcd_endpoint=self.etcd_endpoint if spec.ha else None,
            enable_oplog=spec.enable_oplog,
            lease_ttl_ms=spec.master_lease_ttl_ms,
            client_ttl_s=spec.client_ttl_s,
            eviction_high_watermark_ratio=spec.master_eviction_high_watermark_ratio,
            eviction_ratio=spec.master_eviction_ratio,
            enable_offload=spec.ssd_dir is not None,
            extra_args=spec.master_extra_args,
        )

    def _node_argv(self, name: str) -> list[str]:
        spec = self.spec
        ssd = None
        if spec.ssd_dir is not None:
            ssd = L.NodeSsdArgs(
                root=Path(spec.ssd_dir).absolute(),
                node_name=name,
                cap_bytes=spec.ssd_size_bytes,
                read_buffer_bytes=spec.ssd_read_buffer_bytes,
                # With HA masters the leader moves: the node then waits the whole TTL.
                admin_url=None if spec.ha else self.metrics_url,
                client_ttl_s=spec.client_ttl_s,
                check=spec.ssd_check,
            )
        return L.storage_node_argv(
            master=self.master_address,
            metadata=self.metadata_server,
            segment_bytes=spec.storage_node_segment_bytes,
            local_buffer_bytes=spec.storage_node_local_buffer_bytes,
            host=spec.host,
            ssd=ssd,
        )

    def node_ready_fields(self, i: int) -> dict[str, str]:
        """The ``key=value`` fields of storage node i's READY line (``segment``,
        ``segment_bytes``, with an SSD tier ``ssd_dir`` and ``ssd_cap_bytes``)."""
        node = self._nodes[self._node_index(i)]
        ready = [ln for ln in node.output_text().splitlines() if ln.startswith(L.READY_PREFIX)]
        if not ready:
            return {}
        return dict(f.split("=", 1) for f in ready[-1].split()[1:] if "=" in f)

    def ssd_tiers(self) -> list[dict[str, str]]:
        """Per storage node, ``ssd_dir`` and ``ssd_cap_bytes`` ([] without an SSD tier)."""
        if self.spec.ssd_dir is None:
            return []
        return [
            {k: self.node_ready_fields(i).get(k, "?") for k in ("ssd_dir", "ssd_cap_bytes")}
            for i in range(len(self._nodes))
        ]

    def node_ssd_dir(self, i: int) -> Path | None:
        """Storage node i's own SSD directory, None without an SSD tier."""
        if self.spec.ssd_dir is None:
            return None
        return Path(self.spec.ssd_dir).absolute() / f"node{self._node_index(i)}"

    def _stop_children(self) -> None:
        # Clients before servers, so nodes can unmount while the master is up.
        rest = [c for c in (self._metadata, self._etcd) if c is not None]
        for group in (self._nodes, self._masters, rest):
            L.terminate(group, signal.SIGTERM, self.spec.stop_timeout_s)
