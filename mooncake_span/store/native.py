"""How the client reaches the native library: the binding, its environment defaults,
the reachability probe run before ``setup`` (which can block for minutes),
``setup`` itself, called with every option by name as sglang's MooncakeStore
passes it (``setup_arguments``), and the ``ReplicateConfig`` of a put."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_span.config import SpanOptions
from mooncake_span.errors import ConfigError, SetupError, code_name
from mooncake_span.mooncake_settings import MooncakeSettings
from mooncake_span.store.segments import fetch_disk_owners, fetch_segments, probe_segment

logger = logging.getLogger(__name__)

REACHABILITY_TIMEOUT_S = 2.0
# check_server waits this long for a segment, as sglang's MooncakeStore does.
CHECK_SERVER_TIMEOUT_S = 600.0
_CHECK_SERVER_POLL_S = 3.0
# Mooncake's TCP transport queues 1024 transfers per peer plus 1024 pending admissions.
TCP_QUEUE_BUFFERS = 2048
# Mooncake 0.3.13 reads this once per process, when the first store client is
# set up (later changes, and later clients, keep the first answer): puts then
# record a CRC-64 per object and full-object gets verify it.
CHECKSUM_ENV = "MOONCAKE_STORE_CHECKSUM"
# The values Mooncake reads as on (case-insensitive); anything else is off.
_CHECKSUM_ON = frozenset({"1", "true", "yes", "on"})
_checksum_lock = threading.Lock()
_process_checksums: bool | None = None  # what the first setup by this package got


# Mooncake's wheels on PyPI, one per kind of host; each installs the same
# ``mooncake`` package (0.3.14 exists only as the CUDA 13 build).
MOONCAKE_DISTRIBUTIONS = {
    "mooncake-transfer-engine-non-cuda": "CPU hosts, TCP",
    "mooncake-transfer-engine": "CUDA 12 hosts",
    "mooncake-transfer-engine-cuda13": "CUDA 13 hosts",
    "mooncake-transfer-engine-efa": "AWS EFA hosts",
}


def mooncake_install_hint() -> str:
    """Which distribution to install, for a message that says Mooncake is missing."""
    builds = "; ".join(f"{name} ({kind})" for name, kind in MOONCAKE_DISTRIBUTIONS.items())
    return (
        f"pip install the Mooncake build for this host: {builds}; or install mooncake-span "
        "with the [cpu], [cuda] or [cuda13] extra"
    )


@dataclass(frozen=True)
class MooncakeBuild:
    """An installed distribution that provides the ``mooncake`` package."""

    distribution: str
    version: str
    # The kind of host it is built for; None for a distribution this package does not know.
    host_kind: str | None

    def describe(self) -> str:
        kind = self.host_kind or "not a build this package knows"
        return f"{self.distribution} {self.version} ({kind})"


def installed_mooncake(
    provided: Callable[[], Mapping[str, Sequence[str]]] | None = None,
    version: Callable[[str], str] | None = None,
) -> list[MooncakeBuild]:
    """Every installed distribution that provides ``mooncake`` (more than one overwrite
    each other's files), found by what each distribution installs, not by name."""
    from importlib import metadata

    packages = (provided or metadata.packages_distributions)()
    version_of = version or metadata.version
    canonical = {
        n: n.lower().replace("_", "-").replace(".", "-") for n in packages.get("mooncake", ())
    }
    return [
        MooncakeBuild(c, version_of(n), MOONCAKE_DISTRIBUTIONS.get(c)) for n, c in canonical.items()
    ]


def mooncake_import_failure(exc: ImportError, builds: Sequence[MooncakeBuild] | None = None) -> str:
    """What to tell a user whose ``from mooncake.store import ...`` failed: nothing
    installed, the wrong build for the host, or several builds over each other."""
    builds = installed_mooncake() if builds is None else builds
    if not builds:
        return f"the Mooncake store client is not installed: {mooncake_install_hint()}"
    said = ", ".join(b.describe() for b in builds)
    message = f"the Mooncake store client does not import ({exc}); installed: {said}"
    if len(builds) > 1:
        return (
            f"{message}: these builds install the same files over each other; uninstall "
            f"all of them and install the one for this host ({mooncake_install_hint()})"
        )
    if "libcuda" in str(exc) or "libcudart" in str(exc):
        return (
            f"{message}: a CUDA build needs the NVIDIA driver and runtime on this host; "
            "without a GPU install mooncake-transfer-engine-non-cuda instead"
        )
    return (
        f"{message}; reinstall it, or install the build for this host ({mooncake_install_hint()})"
    )


def probe_tcp(endpoint: str, timeout_s: float) -> None:
    """Connect to ``host:port`` once; SetupError if it does not answer within ``timeout_s``."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise SetupError(f"cannot reach {endpoint}: {exc}") from exc


@dataclass(frozen=True)
class NativeBinding:
    """Where the store class comes from: the real wheel, or a fake in tests."""

    store_factory: Callable[[], Any]  # methods: tests/contract/native_store.py
    replicate_config_factory: Callable[[], Any]
    # Lists the live segment names given the admin URL (None: no answer).
    list_segments: Callable[[str], list[str] | None] = fetch_segments
    # The wheel's client: one checksum setting per process (CHECKSUM_ENV).
    shares_process_env: bool = False
    # Raises SetupError when (endpoint, timeout_s) does not accept a connection;
    # a fake cluster has no endpoint to dial.
    probe_endpoint: Callable[[str, float], None] = probe_tcp
    # Per object key, the segments whose SSD holds it, given the admin URL (None: no answer).
    list_disk_owners: Callable[[str, Sequence[str]], dict[str, set[str]] | None] = fetch_disk_owners
    # Whether a segment's transfer endpoint answers, given the metadata server and
    # the admin URL (None: unknown).
    segment_answers: Callable[[str, str | None, str], bool | None] = probe_segment


@dataclass(frozen=True)
class SharedEngine:
    """A transfer engine this process already runs (sglang's PD disaggregation started it)."""

    session_id: str
    ib_device: str
    # Called only when the engine is reused.
    engine: Callable[[], Any]

    def serves(self, settings: MooncakeSettings) -> bool:
        """sglang 0.5.23's rule: same NIC ("" for both counts), P2P handshake metadata, RDMA."""
        return (
            settings.device_name == self.ib_device
            and settings.metadata_server == "P2PHANDSHAKE"
            and settings.protocol == "rdma"
        )


def setup_arguments(
    settings: MooncakeSettings, shared: SharedEngine | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``MooncakeDistributedStore.setup`` for these settings (a
    reused engine brings its own session id, which then names this client)."""
    reuse = shared is not None and shared.serves(settings)
    return {
        "local_hostname": shared.session_id if reuse else settings.local_hostname,
        "metadata_server": settings.metadata_server,
        "global_segment_size": settings.global_segment_size_bytes,
        "local_buffer_size": settings.local_buffer_size_bytes,
        "protocol": settings.protocol,
        "rdma_devices": settings.device_name,
        "master_server_addr": settings.master_server_address,
        "engine": shared.engine() if reuse else None,
        "enable_ssd_offload": settings.enable_ssd_offload,
        "ssd_offload_path": settings.ssd_offload_path or "",
        "tenant_id": settings.tenant_id,
    }


def reach_cluster(
    settings: MooncakeSettings, options: SpanOptions, binding: NativeBinding
) -> str | None:
    """Before ``setup``: the native environment exported, every endpoint dialled
    once (a dead etcd blocks ``setup`` for minutes), and with ``check_server`` a
    wait for a segment. Returns the master's admin URL (None: not configured)."""
    prepare_native_env(settings, options, binding.shares_process_env)
    endpoints = settings.etcd_endpoints()
    if not settings.master_server_address.startswith("etcd://"):
        endpoints.append(settings.master_server_address)
    for endpoint in endpoints:
        binding.probe_endpoint(endpoint, REACHABILITY_TIMEOUT_S)
    if settings.check_server:
        # sglang's check_server tries the master's default admin port (9003).
        check_url = options.master_admin_url or settings.admin_url()
        if check_url is None:
            raise SetupError("check_server with an etcd master needs span_master_admin_url")
        wait_for_segments(check_url, binding.list_segments)
    # span_master_admin_url overrides the master host on master_metrics_port. No
    # guessed admin URL (sglang's 9003) for placement and SSD owners: a wrong one
    # costs a timeout per refresh.
    return options.master_admin_url or settings.configured_admin_url()


def wait_for_segments(
    url: str,
    list_segments: Callable[[str], list[str] | None],
    timeout_s: float = CHECK_SERVER_TIMEOUT_S,
    poll_s: float = _CHECK_SERVER_POLL_S,
) -> None:
    """``check_server``: return once the master lists a segment; SetupError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        if list_segments(url):
            return
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise SetupError(
                f"check_server: the master's admin server {url} listed no segment within "
                f"{timeout_s:.0f} s; start storage nodes or check master_metrics_port"
            )
        logger.info("mooncake-span: check_server: waiting for a segment at %s", url)
        time.sleep(min(poll_s, left_s))


def setup_store(store: Any, settings: MooncakeSettings, **arguments: Any) -> None:
    """Call ``setup`` by keyword; SetupError says why it failed."""
    if settings.ssd_offload_path is not None and not settings.enable_ssd_offload:
        try:  # sglang's MooncakeStore creates it whether offload is on or not
            os.makedirs(settings.ssd_offload_path, exist_ok=True)
        except OSError as exc:
            raise SetupError(f"cannot create ssd_offload_path: {exc}") from exc
    try:
        rc = store.setup(**arguments)
    # ValueError: e.g. "Invalid FileStorage configuration" for a bad SSD offload setup.
    except (TypeError, RuntimeError, ValueError) as exc:
        raise SetupError(f"Mooncake setup raised {exc!r}") from exc
    if rc != 0:
        raise SetupError(
            f"Mooncake setup failed with code {rc} ({code_name(rc)}) for master "
            f"{settings.master_server_address}, metadata {settings.metadata_server}, "
            f"protocol {settings.protocol}, device {settings.device_name!r}, "
            f"tenant {settings.tenant_id!r}"
        )


def native_env_defaults(options: SpanOptions) -> dict[str, str]:
    return {
        # One stalled transfer (a partitioned peer) blocks this long, then -800.
        "MC_TCP_STATUS_TIMEOUT_SEC": str(options.transfer_timeout_s),
        # With etcd metadata, each setup retry can take ~12 s.
        "MC_STORE_CLIENT_SETUP_RETRIES": "2",
    }


def checksum_setting(options: SpanOptions, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether Mooncake will verify checksums in this process, and what decided it; an
    explicit option that contradicts the export is a ConfigError (docs/reliability.md,
    "What the backend does with it")."""
    exported = environ.get(CHECKSUM_ENV) or None  # exported empty: Mooncake's default
    exported_on = exported is not None and exported.strip().lower() in _CHECKSUM_ON
    origin = options.sources.get("verify_checksums")
    if origin is None:
        return (exported_on, f"{CHECKSUM_ENV}={exported}") if exported else (False, "default")
    if exported is not None and exported_on != options.verify_checksums:
        raise ConfigError(
            f"span_verify_checksums={options.verify_checksums} ({origin}) contradicts "
            f"{CHECKSUM_ENV}={exported!r} in the environment; set one of them, or make them agree"
        )
    return options.verify_checksums, f"span_verify_checksums ({origin})"


def prepare_native_env(
    settings: MooncakeSettings, options: SpanOptions, shares_process_env: bool = False
) -> None:
    """Export the checksum setting and bounded native defaults the operator did not
    set; warn about known traps."""
    global _process_checksums
    verify, why = checksum_setting(options, os.environ)
    if shares_process_env:
        with _checksum_lock:
            first = _process_checksums
            if first is None:
                _process_checksums = verify
        if first is not None and first != verify:
            raise ConfigError(
                f"checksum verification {'on' if verify else 'off'} ({why}) asked for in a "
                f"process whose first Mooncake client was set up with it "
                f"{'on' if first else 'off'}: Mooncake reads {CHECKSUM_ENV} once per process, "
                "so all clients of one process share one setting"
            )
    if verify and os.environ.get(CHECKSUM_ENV, "").strip().lower() not in _CHECKSUM_ON:
        os.environ[CHECKSUM_ENV] = "1"
        logger.info("mooncake-span: %s=1 (%s)", CHECKSUM_ENV, why)
    for name, value in native_env_defaults(options).items():
        if name not in os.environ:
            os.environ[name] = value
            logger.info("mooncake-span: %s=%s (set it yourself to override)", name, value)
    if (
        settings.protocol == "tcp"
        and options.max_buffers_per_call > TCP_QUEUE_BUFFERS
        and "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER" not in os.environ
    ):
        # Past the queue a TCP call does not just slow down: it stalls for
        # Mooncake's 60 s transfer wait and every key in it fails.
        logger.warning(
            "mooncake-span: span_max_buffers_per_call=%d exceeds the TCP transport's %d "
            "queued transfers per peer; raise MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER or lower "
            "the option",
            options.max_buffers_per_call,
            TCP_QUEUE_BUFFERS,
        )
