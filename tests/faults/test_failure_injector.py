"""sglang's own fault injector around MooncakeSpanStore, driven by the real
HybridCacheController on CPU.

``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE=p`` (and ``..._RANDOM_DELAY``)
make ``StorageBackendFactory.create_backend`` wrap the backend in
``HiCacheStorageFailureInjector``, which fails each storage call with
probability p (returning misses without calling the backend) and sleeps a
random delay first. sglang reads both variables when the backend is created,
so setting them for the test is enough.

Many backup -> hit query -> prefetch rounds run through the controller's own
threads in span mode (MLA KV + compressed DSA indexer + Mamba, 4 host pages per
storage key). Whatever the injector breaks, every page the controller reports
restored must carry exactly the bytes backed up under that key.
"""

from __future__ import annotations

import collections
import logging
import random
import time
import uuid

import pytest

pytest.importorskip("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector  # noqa: E402

from mooncake_span.sglang_backend import MooncakeSpanStore  # noqa: E402
from tests.harness.controller import build_compressed_dsa_harness  # noqa: E402

pytestmark = pytest.mark.integration  # a few seconds each: not slow

ROUNDS = 60
# At p=0.5 a round restores only when the backup, the hit query and three gets
# all get through (about 1 round in 40): keep going past ROUNDS until one did,
# so "something got through" is not a coin toss (P(none in 300) < 1e-3).
MAX_ROUNDS = 300
KEYS_PER_BACKUP = 3
RANDOM_DELAY_S = 0.005
_INJECTOR_LOGGER = "sglang.srt.mem_cache.hicache_storage"


def _extra_config(cluster) -> dict:
    return {
        "backend_name": "mooncake_span",
        "module_path": "mooncake_span.sglang_backend",
        "class_name": "MooncakeSpanStore",
        "interface_v1": 1,
        **cluster.client_config(),
    }


@pytest.mark.parametrize("failure_prob", [0.1, 0.5])
def test_injected_failures_never_corrupt_a_restore(
    mooncake_cluster, monkeypatch, caplog, figures, failure_prob
):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", str(failure_prob))
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", str(RANDOM_DELAY_S))
    caplog.set_level(logging.DEBUG, logger=_INJECTOR_LOGGER)
    rng = random.Random(failure_prob)
    started = time.monotonic()
    model = f"inj-{uuid.uuid4().hex[:8]}"
    with build_compressed_dsa_harness(_extra_config(mooncake_cluster), model_name=model) as harness:
        injector = harness.backend
        assert isinstance(injector, HiCacheStorageFailureInjector), type(injector)
        assert isinstance(injector._backend, MooncakeSpanStore), type(injector._backend)
        page = harness.page_tokens
        backups = []
        corrupt: list[str] = []
        totals = collections.Counter()
        round_s = []
        for r in range(MAX_ROUNDS):
            if r >= ROUNDS and totals["prefetch_completed_tokens"]:
                break
            t0 = time.monotonic()
            backup = harness.backup(KEYS_PER_BACKUP, seed=r)
            backups.append(backup)
            totals["backup_attempted_tokens"] += len(backup.token_ids)
            totals["backup_completed_tokens"] += backup.completed_tokens
            # This round's pages plus one never stored; every 3rd round an older backup.
            tokens = list(backup.token_ids) + harness.fresh_tokens(1)
            if r % 3 == 2:
                tokens = list(rng.choice(backups[:-1]).token_ids)
            query = harness.hit_query(tokens)
            totals["prefetch_attempted_tokens"] += len(tokens) // page * page
            totals["hit_tokens"] += query.hit_tokens
            restored = harness.prefetch(query)
            totals["prefetch_completed_tokens"] += restored.completed_tokens
            totals["restored_pages_checked"] += sum(len(p) for p in restored.pages.values())
            corrupt += harness.mismatches(restored, *backups)
            round_s.append(time.monotonic() - t0)
        stats = injector.get_stats()
    elapsed = time.monotonic() - started
    injected = collections.Counter(
        rec.getMessage().rsplit(" ", 1)[-1]
        for rec in caplog.records
        if rec.name == _INJECTOR_LOGGER and rec.getMessage().startswith("Inject failure in")
    )
    figures.update(
        fault=f"sglang HiCacheStorageFailureInjector p={failure_prob}, delay<= {RANDOM_DELAY_S}s, "
        f"real HybridCacheController, span K=4 (KV + compressed indexer + Mamba)",
        rounds=len(round_s),
        **dict(totals),
        injected_failures=dict(injected),
        corrupt_restores=len(corrupt),
        corrupt_detail=corrupt[:5],
        max_round_s=round(max(round_s), 3),
        elapsed_s=round(elapsed, 1),
        backend_error_counts=dict(stats.error_counts),
        backend_rejected_calls=dict(stats.rejected_calls),
        breaker_times_opened=stats.breaker_times_opened,
    )
    assert corrupt == []
    assert sum(injected.values()) > 0, (
        "the injector never fired: is the env read at backend creation?"
    )
    # Something got through, and nothing restored more than it backed up.
    assert 0 < totals["prefetch_completed_tokens"] <= totals["prefetch_attempted_tokens"]
    assert totals["backup_completed_tokens"] <= totals["backup_attempted_tokens"]
    assert stats.breaker_times_opened == 0  # injected misses are not transport failures
