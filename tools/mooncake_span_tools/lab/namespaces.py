"""Low-level network-namespace helpers for the lab: ``ip`` commands, per-thread
``setns`` probes, and finding and signalling the processes inside a namespace.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2's ``ip``.
"""

from __future__ import annotations

import ctypes
import ipaddress
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

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
