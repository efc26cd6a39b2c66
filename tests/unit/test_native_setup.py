"""What the client hands ``MooncakeDistributedStore.setup``: every option by name,
the shared transfer engine under sglang 0.5.23's rule, and check_server's wait."""

from __future__ import annotations

import time

import pytest

from mooncake_span.errors import SetupError
from mooncake_span.mooncake_settings import MooncakeSettings
from mooncake_span.store.native import SharedEngine, setup_arguments, wait_for_segments

RDMA = dict(
    master_server_address="10.0.0.1:50051",
    protocol="rdma",
    device_name="mlx5_3",
    local_hostname="10.0.0.9",
)


def _engine(ib_device: str = "mlx5_3") -> tuple[SharedEngine, object]:
    handle = object()
    return SharedEngine(
        session_id="10.0.0.9:15000", ib_device=ib_device, engine=lambda: handle
    ), handle


def test_every_option_travels_by_name():
    settings = MooncakeSettings(
        **RDMA, tenant_id="t1", enable_ssd_offload=True, ssd_offload_path="/ssd/rank_0_3_0_0"
    )
    assert setup_arguments(settings) == {
        "local_hostname": "10.0.0.9",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 4 << 30,
        "local_buffer_size": 16 << 20,
        "protocol": "rdma",
        "rdma_devices": "mlx5_3",
        "master_server_addr": "10.0.0.1:50051",
        "engine": None,
        "enable_ssd_offload": True,
        "ssd_offload_path": "/ssd/rank_0_3_0_0",
        "tenant_id": "t1",
    }


def test_the_shared_engine_is_reused_on_the_same_nic():
    shared, handle = _engine()
    args = setup_arguments(MooncakeSettings(**RDMA), shared)
    assert args["engine"] is handle and args["local_hostname"] == "10.0.0.9:15000"


@pytest.mark.parametrize(
    "change",
    [
        {"device_name": "mlx5_4"},
        {"protocol": "tcp"},
        {"metadata_server": "http://m:8080/metadata"},
    ],
)
def test_the_shared_engine_is_not_reused_when_it_does_not_match(change):
    shared, _ = _engine()
    args = setup_arguments(MooncakeSettings(**{**RDMA, **change}), shared)
    assert args["engine"] is None and args["local_hostname"] == "10.0.0.9"


def test_check_server_waits_for_a_segment_then_gives_up():
    answers = iter([None, [], ["10.0.0.5:1234"]])
    wait_for_segments("http://m:9003", lambda _url: next(answers), timeout_s=5, poll_s=0.01)
    started = time.monotonic()
    with pytest.raises(SetupError, match="check_server.*http://m:9003"):
        wait_for_segments("http://m:9003", lambda _url: [], timeout_s=0.1, poll_s=0.02)
    assert time.monotonic() - started < 2


def test_the_adapter_finds_the_engine_sglang_started(monkeypatch):
    # sglang keeps the engine its PD disaggregation started in a module global;
    # starting a real one needs an RDMA NIC, so a stand-in with its three methods
    # takes that slot here.
    from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as te

    from mooncake_span.sglang_backend.backend import shared_transfer_engine

    handle = object()

    class StartedEngine:
        def get_session_id(self) -> str:
            return "10.0.0.9:15000"

        def get_ib_device(self) -> str:
            return "mlx5_3"

        def get_engine(self) -> object:
            return handle

    monkeypatch.setattr(te, "_mooncake_transfer_engine", None)
    assert shared_transfer_engine() is None
    monkeypatch.setattr(te, "_mooncake_transfer_engine", StartedEngine())
    shared = shared_transfer_engine()
    assert (shared.session_id, shared.ib_device) == ("10.0.0.9:15000", "mlx5_3")
    assert setup_arguments(MooncakeSettings(**RDMA), shared)["engine"] is handle
