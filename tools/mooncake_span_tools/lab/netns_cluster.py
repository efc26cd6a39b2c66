"""Mooncake on a namespace topology: etcd, masters and storage nodes, one per host.

Command lines, readiness checks and ``ClusterStartError`` come from
:mod:`mooncake_span.ops.launcher`, shared with ``LocalCluster``; a process is
started in its host's namespace through ``NamespaceSite``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_span.ops import launcher as L
from mooncake_span.ops.cluster_spec import sglang_client_config
from mooncake_span.ops.launcher import ClusterStartError, find_executable
from mooncake_span.units import parse_size_bytes
from mooncake_span_tools.lab.topology import NetnsProcess, NetnsTopology

logger = logging.getLogger(__name__)

__all__ = ["ClusterStartError", "NamespaceSite", "NetnsCluster", "NetnsClusterSpec"]

# Fixed ports inside the namespaces (each namespace has its own port space).
MASTER_RPC_PORT = 50051
MASTER_METRICS_PORT = 9003
HTTP_METADATA_PORT = 8080
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380


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


class NamespaceSite:
    """The launcher's ``Site`` for one host of a topology: processes start in
    its namespace and HTTP probes are sent from inside it."""

    def __init__(self, topology: NetnsTopology, host: str):
        self.topology = topology
        self.host = host

    def start(self, name: str, argv: Sequence[str]) -> NetnsProcess:
        return self.topology.spawn(self.host, name, argv)

    def http_get(self, url: str, timeout_s: float) -> tuple[int, str] | None:
        return self.topology.http_get(self.host, url, timeout_s=timeout_s)


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
        """sglang extra-config keys for a client on ``host`` (the keys LocalCluster gives)."""
        return sglang_client_config(
            self.master_address,
            self.metadata_server,
            self.topology.address(host),
            global_segment_size_bytes,
            None if self.spec.ha else self.metrics_url(0),
        )

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
            count = len(self.spec.master_hosts)
            master_bin = L.find_executable("mooncake_master")
            L.start_masters(
                self._master_site,
                [self._master_name(i) for i in range(count)],
                [self._master_args(i).argv(master_bin) for i in range(count)],
                [self.metrics_url(i) for i in range(count)],
                deadline,
                self.masters.__setitem__,
            )
            self.storage_nodes = [
                self._spawn_storage_node(i) for i in range(len(self.spec.storage_hosts))
            ]
            for node in self.storage_nodes:
                L.wait_ready_line(node, deadline)
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
        site = self._master_site(i)
        return L.parse_health(site.http_get(self.metrics_url(i) + "/health", 2.0))

    def summary(self, i: int = 0) -> str | None:
        """Master i's ``/metrics/summary`` text, None if it does not answer."""
        answer = self.topology.http_get(
            self.spec.master_hosts[i], self.metrics_url(i) + "/metrics/summary"
        )
        return None if answer is None or answer[0] != 200 else answer[1]

    def _healths(self) -> list[dict[str, Any] | None]:
        return [
            self.health(i) if master is not None and master.running() else None
            for i, master in enumerate(self.masters)
        ]

    def leader_index(self) -> int | None:
        """Index of the running master that reports itself a serving leader."""
        return next((i for i, h in enumerate(self._healths()) if L.serving_leader(h)), None)

    def wait_for_leader(self, timeout_s: float = 30.0) -> int:
        """Wait until some master is a serving leader; return its index."""
        return L.wait_for_leader(self._healths, timeout_s)

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
        master_bin = L.find_executable("mooncake_master")
        site = self._master_site(i)
        self.masters[i] = site.start(self._master_name(i), self._master_args(i).argv(master_bin))
        deadline = time.monotonic() + (timeout_s or self.spec.start_timeout_s)
        L.wait_master(
            self.masters[i], site, self.metrics_url(i), deadline, serving=not self.spec.ha
        )

    def kill_storage_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        node = self.storage_nodes[i]
        node.signal(sig)
        if node.wait(10.0) is None:
            node.stop(0.5)

    # -- internals ----------------------------------------------------------------------

    def _start_etcd(self, deadline: float) -> None:
        host = self.spec.etcd_host
        assert host is not None  # checked by the caller
        data_dir = self.topology.log_dir / f"{self.name}-etcd-data"
        shutil.rmtree(data_dir, ignore_errors=True)
        argv = L.etcd_argv(
            find_executable("etcd"),
            member=f"{self.name}-etcd",
            data_dir=data_dir,
            host=self.topology.address(host),
            client_port=self._port(ETCD_CLIENT_PORT),
            peer_port=self._port(ETCD_PEER_PORT),
        )
        site = NamespaceSite(self.topology, host)
        self.etcd = site.start(f"{self.name}-etcd", argv)
        url = f"http://{self.etcd_endpoint}/health"
        L.wait_http(self.etcd, site, url, deadline, L.etcd_healthy)

    def _master_site(self, i: int) -> NamespaceSite:
        return NamespaceSite(self.topology, self.spec.master_hosts[i])

    def _master_name(self, i: int) -> str:
        return f"{self.name}-master{i}"

    def _master_args(self, i: int) -> L.MasterArgs:
        spec = self.spec
        return L.MasterArgs(
            host=self.topology.address(spec.master_hosts[i]),
            rpc_port=self._port(MASTER_RPC_PORT, i),
            metrics_port=self._port(MASTER_METRICS_PORT, i),
            # HA keeps the metadata in etcd, so a failover does not lose it.
            http_metadata_port=None if spec.ha else self._port(HTTP_METADATA_PORT),
            ha_etcd_endpoint=self.etcd_endpoint if spec.ha else None,
            enable_oplog=spec.enable_oplog,
            client_ttl_s=spec.client_ttl_s,
        )

    def _spawn_storage_node(self, i: int) -> NetnsProcess:
        host = self.spec.storage_hosts[i]
        argv = L.storage_node_argv(
            master=self.master_address,
            metadata=self.metadata_server,
            segment_bytes=self.spec.segment_bytes,
            local_buffer_bytes=self.spec.local_buffer_bytes,
            host=self.topology.address(host),
        )
        return self.topology.spawn(host, f"{self.name}-node{i}-{host}", argv)
