"""The backend on Mooncake 0.3.14's module layout, over the native client CI installs.

0.3.14 exists only as ``mooncake-transfer-engine-cuda13``, whose native library
links the NVIDIA driver: on a host without it ``import mooncake.store`` raises
``ImportError: libcuda.so.1: cannot open shared object file`` (tried on this
project's CPU box), so CI cannot run it. What 0.3.14 changed in Python, read from
that wheel's own ``mooncake/store/__init__.py``: ``mooncake.store`` holds no
class any more; it is a facade whose module-level ``__getattr__`` (PEP 562) hands
out the names of the native module ``mooncake._store`` (``__dir__`` lists them,
``vars()`` does not), and ``setup`` takes more keyword parameters (the wheel's
own service passes ``enable_client_http_server`` and ``client_http_port``).

The stand-in here has that shape over the installed 0.3.13.post1 client: a
facade module in place of ``mooncake.store``, and a store class whose ``setup``
takes keywords only, 0.3.14's additions included. The backend loads through it
and restores byte-exact, so nothing in it reads the module's attributes or
passes ``setup`` arguments by position.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from mooncake_span.store.client import load_native_binding
from mooncake_span_tools.testing import pools as P
from tests.span_helpers import scattered_pages, slots_of

pytestmark = pytest.mark.integration

PAGE = 64


def facade_over(native: types.ModuleType) -> types.ModuleType:
    """A ``mooncake.store`` shaped like 0.3.14's: no names of its own, ``native``'s on access."""
    facade = types.ModuleType("mooncake.store", "0.3.14's facade, as a stand-in")
    exported = frozenset(n for n in dir(native) if not n.startswith("_"))

    def __getattr__(name: str) -> Any:
        if name in exported:
            return getattr(native, name)
        raise AttributeError(name)

    facade.__getattr__ = __getattr__  # type: ignore[method-assign]
    facade.__dir__ = lambda: sorted(exported)  # type: ignore[method-assign]
    return facade


@pytest.fixture
def mooncake_0314(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``mooncake.store`` replaced by the stand-in; yields every ``setup``'s keywords."""
    import mooncake.store as installed

    calls: list[dict[str, Any]] = []

    class Store(installed.MooncakeDistributedStore):  # type: ignore[misc, valid-type]
        def setup(
            self,
            *,
            enable_client_http_server: bool = False,
            client_http_port: int = 0,
            **arguments: Any,
        ) -> int:
            calls.append(
                {
                    **arguments,
                    "enable_client_http_server": enable_client_http_server,
                    "client_http_port": client_http_port,
                }
            )
            return super().setup(**arguments)

    native = types.ModuleType("mooncake._store")
    native.__dict__.update({n: getattr(installed, n) for n in dir(installed) if n[0] != "_"})
    native.MooncakeDistributedStore = Store
    monkeypatch.setitem(sys.modules, "mooncake._store", native)
    monkeypatch.setitem(sys.modules, "mooncake.store", facade_over(native))
    return calls


def test_the_stand_in_has_the_facades_shape(mooncake_0314):
    facade = sys.modules["mooncake.store"]
    assert "MooncakeDistributedStore" not in vars(facade)
    assert "MooncakeDistributedStore" in dir(facade)
    with pytest.raises(AttributeError):
        facade.NotExported  # noqa: B018
    binding = load_native_binding()
    assert binding.store_factory is sys.modules["mooncake._store"].MooncakeDistributedStore


@pytest.mark.parametrize("pages_per_span", [1, 4])
def test_the_backend_restores_through_the_facade(mooncake_0314, span_store_factory, pages_per_span):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv = P.build_mla_host("page_first", layers=2, host_pages=3 * pages_per_span + 2)
    store = span_store_factory({PoolName.KV: kv}, storage_page_size=PAGE * pages_per_span)
    (setup,) = mooncake_0314
    assert setup["master_server_addr"] and setup["tenant_id"] == "default"
    pages = scattered_pages(3 * pages_per_span + 2, 2 * pages_per_span, seed=pages_per_span)
    starts = [p * PAGE for p in pages]
    P.fill_random_pages(kv, starts, seed=5)
    expected = {s: P.page_bytes(kv, s) for s in starts}
    slots = slots_of(pages, PAGE)
    assert store.batch_set_v1(["a", "b"], slots) == [True, True]
    P.wipe_pages(kv, starts)
    assert store.batch_get_v1(["a", "b"], slots) == [True, True]
    assert {s: P.page_bytes(kv, s) for s in starts} == expected
