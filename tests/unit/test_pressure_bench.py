"""The full-cluster bench's plumbing (bench/pressure.py), on the contract-checked fake.

The real run needs a cluster and minutes; here a few backups go into a fake
segment that holds a fraction of them, so the counts, the restore check and
the cool-down's effect on native puts can be asserted exactly.
"""

from __future__ import annotations

import pytest

from mooncake_span.store.client import NativeBinding
from mooncake_span_tools.bench.pressure import (
    MasterFlags,
    PressureConfig,
    build_rig,
    drive,
    format_row,
    native_counts,
    verify,
)
from mooncake_span_tools.testing.fake_store import FakeCluster, FakeReplicateConfig, FakeStore
from tests.span_helpers import FAKE_CLIENT, FakeClock, skip_probe

# 26 KiB per host page (KV 24 KiB + indexer 2 KiB), 104 KiB per key, 4 keys per call.
CONFIG = PressureConfig(
    segment_bytes=1 << 20, load_ratio=3.0, keys_per_call=4, duration_s=0.01, lookups_per_backup=1
)


@pytest.fixture
def run():
    rigs = []

    def make(cooldown_s: float):
        cluster = FakeCluster(capacity_bytes=CONFIG.segment_bytes)
        binding = NativeBinding(
            lambda: FakeStore(cluster), FakeReplicateConfig, probe_endpoint=skip_probe
        )
        rig = build_rig(CONFIG, FAKE_CLIENT, cooldown_s, binding)
        # The drive's pacing sleeps are skipped, so the cool-down's clock must
        # not run on its own: on a loaded box its 10 ms first pause ended
        # between two calls and a second cool-down began.
        rig.store.client.pressure._now_s = FakeClock()
        rigs.append(rig)
        row = {"cooldown_s": cooldown_s, "master_flags": MasterFlags().label}
        row.update(drive(rig, CONFIG, sleep=lambda s: None))
        row.update(native_counts(rig))
        row.update(verify(rig, CONFIG))
        return rig, row

    yield make
    for rig in rigs:
        rig.close()


def test_counts_without_cooldown(run):
    rig, row = run(0.0)
    calls = len(rig.requests)
    assert calls == 8  # ceil(3 MiB / (104 KiB x 4))
    assert row["offered_keys"] == 4 * calls
    # Every backup sends both pools' puts: KV and indexer objects, plus the guard record.
    assert row["native_put_objects"] == 2 * 4 * calls + 1
    assert row["native_put_answers"]["NO_AVAILABLE_HANDLE"] > 0
    assert 0 < row["stored_keys"] == row["accepted_keys"] < row["offered_keys"]
    assert row["stored_share"] == round(row["stored_keys"] / row["offered_keys"], 4)
    assert row["restored_keys"] > 0 and row["corrupt_restores"] == 0
    assert row["cooldowns_started"] == 0
    assert "cooldown  0.00s" in format_row(row)


def test_cooldown_cuts_native_puts_and_keeps_what_was_stored(run):
    _, storm = run(0.0)
    _, calm = run(60.0)
    assert calm["cooldowns_started"] == 1
    assert calm["native_put_objects"] < storm["native_put_objects"]
    assert calm["client_error_counts"]["FULL_COOLDOWN_SKIPPED"] > 0
    assert calm["stored_keys"] == storm["stored_keys"]
    assert calm["corrupt_restores"] == 0


def test_restore_check_detects_other_bytes(run):
    rig, _ = run(0.0)
    rig.fill(CONFIG.seed, 1, 0)
    assert rig.matches(CONFIG.seed, 1, 0, 4) == [True] * 4
    assert rig.matches(CONFIG.seed, 2, 0, 4) == [False] * 4


def test_config_is_validated():
    with pytest.raises(ValueError, match="newest_share"):
        PressureConfig(newest_share=0)
    assert MasterFlags(0.9, 0.1, 2000).label == "hw 0.9, ratio 0.1, lease_ms 2000"
