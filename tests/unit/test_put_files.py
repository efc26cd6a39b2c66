"""The files one healthy put passes through, found by tracing a real put.

``sys.setprofile`` watches one ``batch_set_v1`` on the contract-checked fake
store, after a first put has fixed the storage page (the steady state of a
serving rank), for the MLA K=1 and the GLM/DSA K=4 pool sets. A package file
counts when code of it runs on the put's path. docs/architecture.md ("How the
two paths are counted") names what is not on the path: the wrappers around
the put (``guard.never_raise``, ``recording.recorded``), which count only the
method they wrap, and the tables that translate native codes (``errors``).
Whatever those call for themselves is left out with them (the metrics and
counters the wrappers feed, and all they read), and so is what the fake store
runs: it stands in for Mooncake.
"""

from __future__ import annotations

import pathlib
import sys
import threading
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest

import mooncake_span
from mooncake_span_tools.testing import fake_store
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import FAKE_CLIENT, slots_of

PACKAGE = pathlib.Path(mooncake_span.__file__).resolve().parent
FAKE_STORE = fake_store.__file__
PAGE = 64
# Not on the path (docs/architecture.md says why); package-relative paths.
NOT_ON_THE_PATH = {
    "sglang_backend/guard.py",
    "sglang_backend/recording.py",
    "errors.py",
}
# Issue #48's target: a healthy put passes through at most 10 package files.
PUT_FILES_BOUND = 10


def _package_file(code: Any) -> str | None:
    path = pathlib.Path(code.co_filename)
    return path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else None


def _wraps(caller: Any, code: Any) -> bool:
    """Whether ``caller`` (a wrapper's frame) is calling the function it wraps."""
    return any(getattr(value, "__code__", None) is code for value in caller.f_locals.values())


class TracedPut(NamedTuple):
    answer: list[bool]
    files: list[str]  # the package files on the path, in the order first reached
    calls: set[tuple[str, str]]  # between files on it: (caller's file, callee's file)
    # Every function on it, "file:qualified name" -> its code; comprehensions and
    # lambdas are read with the function around them.
    functions: dict[str, Any]


def traced_put(store: Any, keys: list[str], slots: Any) -> TracedPut:
    off_path: dict[int, bool] = {}  # id(frame) -> off the path, while the frame runs
    files: dict[str, None] = {}
    calls: set[tuple[str, str]] = set()
    functions: dict[str, Any] = {}

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "return":
            off_path.pop(id(frame), None)
            return
        if event != "call":
            return
        caller = frame.f_back
        off = off_path.get(id(caller), False) if caller is not None else False
        caller_file = _package_file(caller.f_code) if caller is not None else None
        if not off and caller_file in NOT_ON_THE_PATH:
            off = not _wraps(caller, frame.f_code)
        # What the fake store runs (its registered-memory rule among it) stands in for Mooncake.
        off = off or (caller is not None and caller.f_code.co_filename == FAKE_STORE)
        off_path[id(frame)] = off
        name = _package_file(frame.f_code)
        if not off and name is not None and name not in NOT_ON_THE_PATH:
            files.setdefault(name)
            if not frame.f_code.co_name.startswith("<"):
                functions.setdefault(f"{name}:{frame.f_code.co_qualname}", frame.f_code)
            if caller_file not in (None, name, *NOT_ON_THE_PATH):
                calls.add((caller_file, name))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        answer = store.batch_set_v1(keys, slots)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return TracedPut(answer, list(files), calls, functions)


def mla_k1() -> tuple[dict[str, Any], dict[Any, Any]]:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv = P.build_mla_host("page_first", layers=2, host_pages=16)
    return {**FAKE_CLIENT, "storage_page_size": PAGE}, {PoolName.KV: kv}


def glm_dsa_k4() -> tuple[dict[str, Any], dict[Any, Any]]:
    pools = P.build_compressed_hybrid_dsa("page_first", host_pages=16, mamba_slots=4)
    return {**FAKE_CLIENT, "storage_page_size": 4 * PAGE}, pools.pools


class _Chained:
    """A backend whose ``batch_set_v1`` names the keys' prefix chain, as sglang does
    with ``hicache_storage_pass_prefix_keys``: ``a, b`` come before ``c, d``."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def batch_set_v1(self, keys: list[str], slots: Any) -> list[bool]:
        return self._store.batch_set_v1(keys, slots, SimpleNamespace(prefix_keys=["a", "b"]))


def steady_put(make_backend: Any, shape: Any, *, chained: bool = False) -> TracedPut:
    """A put traced after a first one fixed the storage page, on the fake store."""
    config, pools = shape()
    k = config["storage_page_size"] // PAGE
    store = make_backend(config, pools, cluster=FakeCluster())
    first = SimpleNamespace(prefix_keys=[]) if chained else None
    assert store.batch_set_v1(["a", "b"], slots_of(list(range(2 * k)), PAGE), first) == [
        True,
        True,
    ]
    target = _Chained(store) if chained else store
    return traced_put(target, ["c", "d"], slots_of(list(range(2 * k, 4 * k)), PAGE))


@pytest.mark.parametrize("shape", [mla_k1, glm_dsa_k4], ids=["mla-k1", "glm-dsa-k4"])
def test_a_healthy_put_passes_through_few_files(make_backend, shape):
    answer, files, _, _ = steady_put(make_backend, shape)
    assert answer == [True, True]
    assert "sglang_backend/writes.py" in files and "store/client.py" in files
    assert len(files) <= PUT_FILES_BOUND, f"{len(files)} files: {files}"


@pytest.mark.parametrize("shape", [mla_k1, glm_dsa_k4], ids=["mla-k1", "glm-dsa-k4"])
def test_a_backup_that_names_its_chain_reads_two_files_more(make_backend, shape):
    plain = steady_put(make_backend, shape)
    chained = steady_put(make_backend, shape, chained=True)
    assert chained.answer == [True, True]
    # The chain's placement steps and the sampling of chain records (the page says so).
    assert set(chained.files) - set(plain.files) == {"store/domains.py", "span/chains.py"}
    assert set(plain.files) <= set(chained.files)


# The store's layers on a put, top-down: the client hands calls down, DomainCalls
# carries out what the router decides, the gate makes the native calls.
STORE_LAYERS = ("store/client.py", "store/domain_calls.py", "store/router.py", "store/gate.py")


def upward_calls(calls: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """The calls from a store layer into one above it, or into the adapter."""
    rank = {name: i for i, name in enumerate(STORE_LAYERS)}

    def level(name: str) -> int | None:
        return -1 if name.startswith("sglang_backend/") else rank.get(name)

    return sorted(
        (caller, callee)
        for caller, callee in calls
        if caller in rank and (up := level(callee)) is not None and up < rank[caller]
    )


@pytest.mark.parametrize("shape", [mla_k1, glm_dsa_k4], ids=["mla-k1", "glm-dsa-k4"])
def test_a_healthy_put_runs_one_way_down_the_store(make_backend, shape):
    answer, _, calls, _ = steady_put(make_backend, shape)
    assert answer == [True, True]
    # Each layer is reached from the one above it...
    assert ("store/client.py", "store/domain_calls.py") in calls
    assert ("store/domain_calls.py", "store/gate.py") in calls
    # ...and nothing below calls back up: not the client from DomainCalls, not
    # DomainCalls from the router or the gate.
    assert upward_calls(calls) == []


def test_the_one_way_check_sees_a_call_back_up():
    back = {("store/domain_calls.py", "store/client.py"), ("store/router.py", "store/client.py")}
    down = {("sglang_backend/writes.py", "store/client.py"), ("store/client.py", "store/gate.py")}
    assert upward_calls(back | down) == sorted(back)
