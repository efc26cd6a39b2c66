"""Shared fixtures: a real Mooncake cluster for the integration tests, and
``make_backend`` (a MooncakeSpanStore on the fake store) for the unit tests.

By default ``mooncake_cluster`` starts a private cluster for the session:
one master with the embedded HTTP metadata server and one storage node of
512 MB, so stored data lives outside the test process. Point the tests at an
existing deployment instead with

    pytest --mooncake-master HOST:PORT --mooncake-metadata URL
    # or MOONCAKE_SPAN_TEST_MASTER / MOONCAKE_SPAN_TEST_METADATA

Tests marked ``integration`` are skipped when Mooncake (``mooncake_master``
and ``mooncake.store``) is missing, except when ``CI`` is set: there they fail,
because CI must never pass by skipping.

A run stopped partway leaves nothing behind: SIGTERM interrupts it as Ctrl-C
does, so every fixture's finalizer stops its servers and namespaces; every
child process dies with the run in any case (``launcher.popen_tied``); and
namespaces a killed run left are removed when the next run starts.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from mooncake_span.ops.cluster import ClusterSpec, ExternalCluster, LocalCluster, find_executable
from mooncake_span.ops.launcher import die_with_parent
from mooncake_span_tools.lab.sglang_servers import EXTENSIONS_ENV, extensions_dir

_MASTER_ENV = "MOONCAKE_SPAN_TEST_MASTER"
_METADATA_ENV = "MOONCAKE_SPAN_TEST_METADATA"
_SESSION_SEGMENT_BYTES = 512 << 20
_CLIENT_LOCAL_BUFFER_BYTES = 64 << 20
_EXTERNAL_KEY = pytest.StashKey["ExternalCluster | None"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mooncake", "Mooncake integration tests")
    group.addoption(
        "--mooncake-master",
        default=None,
        metavar="HOST:PORT",
        help=f"use this running Mooncake master instead of starting one (env {_MASTER_ENV})",
    )
    group.addoption(
        "--mooncake-metadata",
        default=None,
        metavar="URL",
        help=f"metadata server of that external cluster, e.g. http://HOST:PORT/metadata "
        f"(env {_METADATA_ENV})",
    )


def pytest_configure(config: pytest.Config) -> None:
    # The transfer engine otherwise advertises the first non-loopback
    # interface, which loopback-only clusters cannot reach.
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    # sglang's JIT extensions (the page hash a backend loads at registration)
    # in this venv's own folder, as the servers the tests start use it: the
    # shared default is rebuilt whenever another venv loads it.
    os.environ.setdefault(EXTENSIONS_ENV, extensions_dir())
    # Parse the external-cluster options once, so a bad value stops the run
    # with a usage error instead of erroring every integration test.
    config.stash[_EXTERNAL_KEY] = _external_cluster(config)
    if hasattr(config, "workerinput"):
        # An xdist worker dies with the controller, and its children with it: the
        # parent-death SIGKILL that popen_tied gives the processes it starts.
        die_with_parent(os.getppid())()
    if _is_xdist_controller(config):
        signal.signal(signal.SIGTERM, _forward_sigterm_to_workers)
    else:
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(config.getoption("numprocesses", None))


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    # As Ctrl-C: pytest then runs every finalizer (servers, clusters, namespaces)
    # and ends the session. A second SIGTERM ends the run at once; the children
    # then die with it (their parent-death signal).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def _forward_sigterm_to_workers(signum: int, frame: object) -> None:
    # The xdist controller runs no test: its children are its workers. Each one
    # is interrupted as above and runs its finalizers; xdist then ends the run
    # as interrupted. Interrupted itself, the controller would tear the workers
    # down with a 10 s kill deadline, too short for a lane's servers to stop.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for pid in _child_pids():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _child_pids() -> list[int]:
    pids: list[int] = []
    for children in Path("/proc/self/task").glob("*/children"):
        try:
            pids.extend(int(pid) for pid in children.read_text().split())
        except OSError:
            continue
    return pids


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remove the namespaces of earlier runs that died before their finalizers ran."""
    from mooncake_span_tools.lab.netns import remove_stale_runs

    # Their state files name the namespaces and the owner pid (see lab.topology).
    if os.geteuid() == 0 and shutil.which("ip") is not None:
        remove_stale_runs()


# Every test of these folders carries the folder's marker, so the inner loop
# (`-m "not servers and not faults and not netns"`: unit, contract and
# integration) can leave them out whatever marks a file sets itself.
_FOLDER_MARKERS = {"servers": "servers", "faults": "faults", "netns": "netns"}

# pytest-xdist (`-n 4 --dist loadscope`, pyproject.toml) hands out one group of
# tests at a time to a worker, so a group's module- and session-scoped fixtures
# are built once. A test's group is its module unless named here: the
# real-server modules run in two lanes of about equal length (measured), so
# that at most two of them hold servers at once, and each lane starts its
# reference servers once. Three lanes ran the 24 GB box out of memory (a lane
# holds up to seven servers of about 1.2 GB each).
_SHARED_GROUPS = {
    "tests/servers/test_two_servers.py": "servers-lane-a",
    "tests/servers/test_validate.py": "servers-lane-a",
    "tests/servers/test_servers_on_hosts.py": "servers-lane-a",
    "tests/servers/test_demo.py": "servers-lane-b",
    "tests/servers/test_glm5_pd.py": "servers-lane-b",
    "tests/servers/test_glm5_next.py": "servers-lane-b",
    "tests/servers/test_pd.py": "servers-lane-b",
    "tests/servers/test_chain_placement_serving.py": "servers-lane-b",
    "tests/servers/test_faults_while_serving.py": "servers-lane-b",
    "tests/servers/test_ssd_restart.py": "servers-lane-b",
}
# Groups are handed out in this folder order, the longest first, so that the
# many short unit modules fill the gaps at the end instead of a server lane
# starting last.
_FOLDER_ORDER = ("servers", "netns", "faults", "integration", "contract", "unit")


def xdist_group_of(nodeid: str) -> str:
    """The xdist work unit of a test: its lane, or else its module."""
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/servers/"):
        # A server module not yet placed joins a lane rather than become a third
        # concurrent holder of servers.
        return _SHARED_GROUPS.get(module, "servers-lane-b")
    return _SHARED_GROUPS.get(module, module)


def _folder_rank(nodeid: str) -> int:
    parts = nodeid.split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    return _FOLDER_ORDER.index(folder) if folder in _FOLDER_ORDER else len(_FOLDER_ORDER)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    # xdist's own `loadgroup` marks groups by rewriting node ids, which pytest 9
    # no longer reads; the scope is taken from the node id here instead.
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).parent
    for item in items:
        try:
            folder = Path(item.path).relative_to(tests_dir).parts[0]
        except ValueError:
            continue
        marker = _FOLDER_MARKERS.get(folder)
        if marker is not None:
            item.add_marker(marker)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Every worker sorts alike (xdist requires identical collections), and
        # with --no-loadscope-reorder the groups are handed out in this order.
        items.sort(key=lambda item: _folder_rank(item.nodeid))


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@functools.cache
def _missing_mooncake(need_binaries: bool) -> str | None:
    """Why Mooncake cannot be used here, or None if it can."""
    try:
        has_store = importlib.util.find_spec("mooncake.store") is not None
    except ModuleNotFoundError:
        has_store = False
    if not has_store:
        return "the mooncake.store module is not importable (pip install 'mooncake-span[cpu]')"
    if need_binaries:
        try:
            find_executable("mooncake_master")
        except FileNotFoundError as exc:
            return str(exc)
    return None


def require_mooncake(*, need_binaries: bool = True) -> None:
    """Skip the calling test when Mooncake is missing; fail instead under CI."""
    reason = _missing_mooncake(need_binaries)
    if reason is None:
        return
    if _in_ci():
        pytest.fail(f"{reason}; CI is set, so integration tests must not be skipped", pytrace=False)
    pytest.skip(reason)


@functools.cache
def _netns_reason() -> str | None:
    from mooncake_span_tools.lab.netns import netns_unavailable_reason

    return netns_unavailable_reason()


def require_netns() -> None:
    """Skip when network namespaces cannot be created here; fail instead under CI."""
    reason = _netns_reason()
    if reason is None:
        return
    if _in_ci():
        pytest.fail(
            f"network namespaces unavailable: {reason}; CI is set, so netns tests must run",
            pytrace=False,
        )
    pytest.skip(f"network namespaces unavailable: {reason}")


def _external_cluster(config: pytest.Config) -> ExternalCluster | None:
    master = config.getoption("--mooncake-master") or os.environ.get(_MASTER_ENV)
    metadata = config.getoption("--mooncake-metadata") or os.environ.get(_METADATA_ENV)
    if not master and not metadata:
        return None
    if not master or not metadata:
        raise pytest.UsageError(
            "an external Mooncake cluster needs both --mooncake-master and --mooncake-metadata "
            f"(or {_MASTER_ENV} and {_METADATA_ENV})"
        )
    try:
        return ExternalCluster(master_address=master, metadata_server=metadata)
    except ValueError as exc:
        raise pytest.UsageError(f"bad external Mooncake cluster: {exc}") from None


@pytest.fixture(autouse=True)
def _require_mooncake_for_integration(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("integration") is not None:
        require_mooncake(need_binaries=request.config.stash[_EXTERNAL_KEY] is None)


@pytest.fixture(scope="session")
def mooncake_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster | ExternalCluster]:
    """A running cluster; offers ``client_config()`` and ``client_env()``.

    A ``LocalCluster`` (master + embedded metadata + one 512 MB storage node,
    default lease) unless an external cluster was configured, in which case an
    ``ExternalCluster`` with the same client-facing API.
    """
    external = request.config.stash[_EXTERNAL_KEY]
    if external is not None:
        require_mooncake(need_binaries=False)
        yield external
        return
    require_mooncake(need_binaries=True)
    spec = ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=_SESSION_SEGMENT_BYTES,
        log_dir=tmp_path_factory.mktemp("mooncake-cluster"),
    )
    with LocalCluster(spec) as cluster:
        yield cluster


@pytest.fixture
def key_namespace() -> str:
    """A key prefix unique to this test, e.g. ``t-1a2b3c4d``."""
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def mooncake_store_factory(
    mooncake_cluster: LocalCluster | ExternalCluster,
) -> Iterator[Callable[..., object]]:
    """Make ``MooncakeDistributedStore`` clients of ``mooncake_cluster``.

    ``factory(global_segment_size_bytes=0, local_buffer_size_bytes=64 MiB)``
    returns a set-up store. Each is closed exactly once after the test; do not
    close them yourself (any call after close() segfaults).
    """
    from mooncake.store import MooncakeDistributedStore

    for name, value in mooncake_cluster.client_env().items():
        os.environ.setdefault(name, value)
    stores: list[object] = []

    def factory(
        global_segment_size_bytes: int = 0,
        local_buffer_size_bytes: int = _CLIENT_LOCAL_BUFFER_BYTES,
    ) -> object:
        config = mooncake_cluster.client_config(global_segment_size_bytes)
        store = MooncakeDistributedStore()
        # By name, as the backend calls it: later wheels add parameters.
        rc = store.setup(
            local_hostname=config["local_hostname"],
            metadata_server=config["metadata_server"],
            global_segment_size=config["global_segment_size"],
            local_buffer_size=local_buffer_size_bytes,
            protocol=config["protocol"],
            rdma_devices="",
            master_server_addr=config["master_server_address"],
        )
        assert rc == 0, f"MooncakeDistributedStore.setup returned {rc} for {config}"
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


@pytest.fixture
def make_backend() -> Iterator[Callable[..., Any]]:
    """``make(config, pools=None, *, cluster=None, native=None, is_mla=True)`` ->
    a MooncakeSpanStore on the fake store (see ``span_helpers.fake_backend``),
    with ``pools`` (PoolName -> host pool) registered as sglang does when given.

    The master's reachability probe is skipped, so no port is needed.
    Every store is closed after the test.
    """
    from tests.span_helpers import fake_backend, register_pools

    stores: list[Any] = []

    def make(
        config: Any,
        pools: Mapping[Any, Any] | None = None,
        *,
        cluster: Any = None,
        native: Callable[[Any], Any] | None = None,
        is_mla: bool = True,
    ) -> Any:
        store = fake_backend(config, cluster=cluster, native=native, is_mla=is_mla)
        stores.append(store)
        if pools is not None:
            register_pools(store, pools)
        return store

    yield make
    for store in stores:
        store.close()
