"""What one client reports (``stats()``), read from the owner of each count; writes
nothing. ``revision`` is cheap and changes whenever ``snapshot`` has news, so the
metrics are rebuilt only then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mooncake_span.store.gate import NativeGate
from mooncake_span.store.integrity import IntegrityFailures
from mooncake_span.store.router import FailureLedger, PutPressure
from mooncake_span.store.serving_ssd import ServingSsd


@dataclass(eq=False)
class ClientStats:
    gate: NativeGate
    ledger: FailureLedger
    pressure: PutPressure
    ssd: ServingSsd
    integrity: IntegrityFailures
    segments: Callable[[], tuple[str, ...]]

    def revision(self) -> tuple[int, bool, int, int, int]:
        """Every failure is counted, and the breaker and segment marks follow them."""
        return (
            *self.gate.revision(),
            self.ledger.times_marked,
            self.pressure.skipped_total,
            self.ssd.read_rpcs,
        )

    def snapshot(self) -> dict[str, Any]:
        breaker = self.gate.breaker()
        return {
            "error_counts": self.gate.counts(),
            "breaker_state": breaker.state.value,
            "breaker_consecutive_failures": breaker.consecutive_failures,
            "breaker_times_opened": breaker.times_opened,
            "segments": list(self.segments()),
            "bad_segments": sorted(self.ledger.bad_segments()),
            "full_segments": sorted(self.ledger.full_segments()),
            "domains_marked_bad": self.ledger.times_marked,
            "lost_keys": self.ledger.lost_count,
            "skipped_backups": self.pressure.skipped(),
            "ssd_read_rpcs": self.ssd.read_rpcs,
            **self.integrity.snapshot(),
        }
