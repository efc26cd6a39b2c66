"""span_verify_checksums and what a corrupt object does to a read, without a cluster.

The real behaviour (Mooncake's CRC-64, CHECKSUM_MISMATCH on a flipped byte, when
the variable is read) is shown against a real master in
tests/faults/test_checksums.py; here: the option's sources and conflicts, and
the client's handling of an integrity code on the contract-checked fake.
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import prometheus_client as prom
import pytest

from mooncake_span import metrics as M
from mooncake_span.config import load_span_options
from mooncake_span.errors import ConfigError, ErrorCode, TransportError, is_integrity_failure
from mooncake_span.mooncake_settings import MooncakeSettings
from mooncake_span.ops import doctor
from mooncake_span.span.plan import ObjectPlan
from mooncake_span.store import native
from mooncake_span.store.integrity import IntegrityFailures
from mooncake_span_tools.testing.fake_store import FakeCluster
from tests.span_helpers import FakeClock, fake_client, listening_port

ENV = native.CHECKSUM_ENV
OBJECT_BYTES = 256
MISMATCH = int(ErrorCode.CHECKSUM_MISMATCH)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (ENV, "MOONCAKE_SPAN_VERIFY_CHECKSUMS"):
        # setenv first, so the undo also removes what the code under test exports
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(native, "_process_checksums", None)


def test_the_option_is_off_by_default_and_read_from_extra_config_and_env():
    assert load_span_options({}, {}).verify_checksums is False
    assert load_span_options({"span_verify_checksums": True}, {}).verify_checksums is True
    env = {"MOONCAKE_SPAN_VERIFY_CHECKSUMS": "1"}
    assert load_span_options({}, env).verify_checksums is True
    # extra-config wins over the environment, as for every span_* option
    assert load_span_options({"span_verify_checksums": "false"}, env).verify_checksums is False
    with pytest.raises(ConfigError, match="span_verify_checksums"):
        load_span_options({"span_verify_checksums": "sometimes"}, {})


@pytest.mark.parametrize(
    ("extra", "exported", "want"),
    [
        ({}, None, (False, "default")),
        ({}, "1", (True, f"{ENV}=1")),
        ({}, "TRUE", (True, f"{ENV}=TRUE")),
        ({}, "on", (True, f"{ENV}=on")),
        ({}, "0", (False, f"{ENV}=0")),
        ({}, "2", (False, f"{ENV}=2")),  # Mooncake reads 2 as off too
        ({}, "", (False, "default")),
        ({"span_verify_checksums": True}, "", (True, "span_verify_checksums (extra_config)")),
        ({"span_verify_checksums": True}, None, (True, "span_verify_checksums (extra_config)")),
        ({"span_verify_checksums": True}, "yes", (True, "span_verify_checksums (extra_config)")),
        ({"span_verify_checksums": False}, "0", (False, "span_verify_checksums (extra_config)")),
    ],
)
def test_checksum_setting_follows_the_option_or_the_operators_export(extra, exported, want):
    environ = {} if exported is None else {ENV: exported}
    assert native.checksum_setting(load_span_options(extra, {}), environ) == want


@pytest.mark.parametrize(("value", "exported"), [(True, "0"), (False, "1"), (True, "false")])
def test_an_explicit_option_contradicting_the_export_names_both(value, exported):
    options = load_span_options({"span_verify_checksums": value}, {})
    with pytest.raises(ConfigError, match=f"span_verify_checksums={value}.*{ENV}='{exported}'"):
        native.checksum_setting(options, {ENV: exported})


def _settings() -> MooncakeSettings:
    return MooncakeSettings(
        master_server_address="127.0.0.1:50051", metadata_server="P2PHANDSHAKE", protocol="tcp"
    )


def test_the_option_exports_the_variable_before_setup(monkeypatch):
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "5")
    native.prepare_native_env(_settings(), load_span_options({}, {}))
    assert ENV not in os.environ  # off by default: nothing exported
    native.prepare_native_env(_settings(), load_span_options({"span_verify_checksums": 1}, {}))
    assert os.environ[ENV] == "1"


def test_one_process_cannot_mix_settings_on_the_real_client():
    on = load_span_options({"span_verify_checksums": True}, {})
    off = load_span_options({"span_verify_checksums": False}, {})
    native.prepare_native_env(_settings(), off, shares_process_env=True)
    with pytest.raises(ConfigError, match="once per process"):
        native.prepare_native_env(_settings(), on, shares_process_env=True)
    # A fake (or any binding that does not share the process' native client) is free.
    native.prepare_native_env(_settings(), on, shares_process_env=False)


def test_broken_object_codes_are_integrity_codes_and_nothing_else():
    broken = {
        ErrorCode.CHECKSUM_MISMATCH,
        ErrorCode.SEAL_MISMATCH,
        ErrorCode.FILE_NOT_FOUND,
        ErrorCode.FILE_READ_FAIL,
    }
    assert MISMATCH in broken
    assert {c for c in ErrorCode if is_integrity_failure(int(c))} == broken


# ---- the client's get path on the fake ------------------------------------------


@pytest.fixture
def client_and_cluster():
    cluster = FakeCluster()
    with listening_port() as master:
        client = fake_client(master, cluster, placement=False)
        yield client, cluster
        client.close()


def _plans(client, array: np.ndarray, n: int) -> list[ObjectPlan]:
    client.register_buffer(array.ctypes.data, array.nbytes)  # as RDMA needs it
    return [ObjectPlan([array.ctypes.data + i * OBJECT_BYTES], [OBJECT_BYTES]) for i in range(n)]


def _write(client, keys: list[str]) -> np.ndarray:
    source = np.random.default_rng(3).integers(0, 256, len(keys) * OBJECT_BYTES, dtype=np.uint8)
    assert client.put(keys, _plans(client, source, len(keys))) == [True] * len(keys)
    return source


def test_a_checksum_mismatch_reads_as_a_miss_and_the_object_is_removed(client_and_cluster):
    client, cluster = client_and_cluster
    keys = ["a__kv", "b__kv"]
    _write(client, keys)
    target = np.zeros(len(keys) * OBJECT_BYTES, dtype=np.uint8)
    cluster.inject("batch_get_into_multi_buffers", MISMATCH)
    assert client.get(keys, _plans(client, target, 2)) == [False, False]
    cluster.calls.clear()
    assert client.exists(keys) == [False, False]  # the lost-key cache answers
    assert not any(name == "batch_is_exist" for name, _ in cluster.calls)
    assert set(cluster.objects).isdisjoint(keys)  # removed: no other client offers it
    stats = client.stats()
    assert stats["integrity_failures"] == {"CHECKSUM_MISMATCH": 2}
    assert stats["integrity_removed"] == 2
    assert stats["error_counts"]["CHECKSUM_MISMATCH"] == 2
    assert stats["breaker_consecutive_failures"] == 0  # a corrupt object is not a dead cluster
    # A fresh backup makes the key readable again.
    source = _write(client, keys)
    assert client.get(keys, _plans(client, target, 2)) == [True, True]
    assert ctypes.string_at(target.ctypes.data, target.nbytes) == source.tobytes()


def test_a_failed_removal_never_raises_and_the_key_stays_a_miss(client_and_cluster):
    client, cluster = client_and_cluster
    _write(client, ["a__kv"])
    target = np.zeros(OBJECT_BYTES, dtype=np.uint8)
    cluster.inject("batch_get_into_multi_buffers", MISMATCH)
    cluster.inject("remove", int(ErrorCode.OBJECT_HAS_LEASE))
    assert client.get(["a__kv"], _plans(client, target, 1)) == [False]
    assert "a__kv" in cluster.objects
    assert client.exists(["a__kv"]) == [False]
    assert client.stats()["integrity_removed"] == 0


def test_a_corrupt_copy_falls_back_to_the_next_one():
    cluster = FakeCluster(segments=("127.0.0.1:12001", "127.0.0.1:12002"))
    with listening_port() as master:
        client = fake_client(master, cluster, replica_num=2)
        try:
            source = _write(client, ["a__kv"])
            target = np.zeros(OBJECT_BYTES, dtype=np.uint8)
            cluster.inject("batch_get_into_multi_buffers", MISMATCH)
            assert client.get(["a__kv"], _plans(client, target, 1)) == [True]
            assert target.tobytes() == source.tobytes()
            assert client.exists(["a__kv"]) == [True]  # one good copy left: still a hit
            assert client.stats()["integrity_failures"] == {"CHECKSUM_MISMATCH": 1}
        finally:
            client.close()


def test_integrity_failures_log_once_per_interval(caplog):
    removed: list[str] = []
    clock = FakeClock()
    failures = IntegrityFailures(lambda key: removed.append(key) or 0, clock)
    with caplog.at_level(logging.ERROR, logger="mooncake_span.store.integrity"):
        assert failures.record([("a", 64, MISMATCH), ("b", 64, 64)]) == ["a"]
        clock.advance(9.0)
        assert failures.record([("c", 64, MISMATCH)]) == ["c"]
        assert failures.record([("d", 64, int(ErrorCode.TRANSFER_FAIL))]) == []
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "CHECKSUM_MISMATCH" in lines[0] and "a" in lines[0]
        clock.advance(1.0)  # the interval is up: the next one logs, with the count it held
        assert failures.record([("e", 64, MISMATCH)]) == ["e"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "e" in lines[1] and "(1 more since the last line)" in lines[1]
    assert removed == ["a", "c", "e"]
    assert failures.snapshot()["integrity_failures"] == {"CHECKSUM_MISMATCH": 3}


def test_a_removal_that_fails_still_reads_as_a_miss_and_counts_nothing_removed():
    def remove(key):
        if key == "a":
            raise TransportError("master gone")
        return 0 if key == "b" else int(ErrorCode.OBJECT_NOT_FOUND)

    failures = IntegrityFailures(remove)
    found = [("a", 64, MISMATCH), ("b", 64, MISMATCH), ("c", 64, MISMATCH)]
    assert failures.record(found) == ["a", "b", "c"]
    assert failures.snapshot() == {
        "integrity_failures": {"CHECKSUM_MISMATCH": 3},
        "integrity_removed": 1,
    }


def test_integrity_failures_become_a_counter():
    registry = prom.CollectorRegistry()
    sync = M.ClientStatsSync(M.get_metrics(registry))
    for n in (1, 3, 3):
        sync.sync({"error_counts": {}, "integrity_failures": {"CHECKSUM_MISMATCH": n}})
    value = registry.get_sample_value(
        "mooncake_span_integrity_failures_total", {"code": "CHECKSUM_MISMATCH"}
    )
    assert value == 3


@pytest.mark.parametrize(
    ("extra", "exported", "status", "verify"),
    [
        ({}, None, doctor.PASS, False),
        ({"span_verify_checksums": True}, None, doctor.PASS, True),
        ({}, "1", doctor.PASS, True),
        ({"span_verify_checksums": True}, "0", doctor.FAIL, None),
    ],
)
def test_doctor_reports_the_setting(monkeypatch, extra, exported, status, verify):
    if exported is not None:
        monkeypatch.setenv(ENV, exported)
    (check,) = doctor.check_checksums(doctor.Context(extra=extra))
    assert check.status == status
    assert check.data.get("verify_checksums") == verify
    if status == doctor.FAIL:
        assert ENV in check.detail and "span_verify_checksums" in check.detail


def test_the_checksum_bench_pairs_each_round():
    from mooncake_span_tools.bench.checksum import summarize

    def child(put: list[float], get: list[float]) -> dict:
        return {
            "same/64KiB": {"page_bytes": 10_000_000, "put_pages_per_s": put, "get_pages_per_s": get}
        }

    rounds = [
        {"off": child([100, 110, 90], [200, 200, 200]), "on": child([50, 50, 60], [100, 90, 110])},
        {"on": child([30, 30, 30], [80, 80, 80]), "off": child([60, 60, 60], [100, 100, 100])},
    ]
    row = summarize(rounds)["same/64KiB"]
    assert row["put"]["on_over_off_rounds"] == [0.5, 0.5]
    assert row["get"]["on_over_off_rounds"] == [0.5, 0.8]
    assert row["get"]["on_over_off_median"] == 0.65
    assert row["put"]["off_pages_per_s"] == 75  # median of all six off samples
    assert row["get"]["on_pages_per_s"] == 85
    assert row["get"]["on_gb_per_s"] == 0.85
