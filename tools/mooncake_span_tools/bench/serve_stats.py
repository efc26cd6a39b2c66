"""Pure parts of the serving benchmark (``mooncake-span bench --serve``); no servers.

Round order (the readers' order cycles through every permutation), percentiles,
per-round paired ratios, the greedy-token agreement check that fails a run, and
deltas of Prometheus text scrapes for the TTFT breakdown.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

RECOMPUTE = "recompute"
SPAN = "span"
MOONCAKE = "mooncake"
ARMS = (RECOMPUTE, SPAN, MOONCAKE)
L3_ARMS = (SPAN, MOONCAKE)
# (numerator, denominator) of the paired per-round TTFT ratios.
RATIO_PAIRS = ((SPAN, RECOMPUTE), (SPAN, MOONCAKE), (MOONCAKE, RECOMPUTE))

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


class DisagreementError(RuntimeError):
    """Two arms (readers or writers) returned different greedy tokens for one prompt."""


def round_order(arms: Sequence[str], round_index: int) -> tuple[str, ...]:
    """The order round ``round_index`` runs the arms in: every permutation in turn.

    A plain rotation keeps each arm behind the same neighbour (the arm after
    recompute would always pay for recompute's write-back); cycling through all
    permutations puts every arm first, and behind every other arm, equally often.
    """
    if not arms:
        raise ValueError("no arms to order")
    orders = list(itertools.permutations(arms))
    return orders[round_index % len(orders)]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def paired_ratios(rounds: Sequence[Mapping[str, Any]], numerator: str, denominator: str) -> list:
    """Per round, ``numerator``'s reader TTFT over ``denominator``'s, both from that round."""
    return [
        r["arms"][numerator]["ttft_s"] / r["arms"][denominator]["ttft_s"]
        for r in rounds
        if r["arms"][denominator]["ttft_s"] > 0
    ]


def disagreeing(outputs: Mapping[str, Sequence[int]]) -> list[str]:
    """Names whose tokens differ from the first name's (empty when all agree)."""
    items = list(outputs.items())
    if not items:
        return []
    reference = tuple(items[0][1])
    return [name for name, tokens in items[1:] if tuple(tokens) != reference]


def round_outputs(record: Mapping[str, Any]) -> dict[str, Sequence[int]]:
    """Every greedy answer of one round: readers first (recompute leads), then writers."""
    outputs = {arm: record["arms"][arm]["output_ids"] for arm in ARMS if arm in record["arms"]}
    for arm, writer in record.get("writers", {}).items():
        outputs[f"{arm}-writer"] = writer["output_ids"]
    return outputs


def check_agreement(rounds: Sequence[Mapping[str, Any]]) -> None:
    """Raise :class:`DisagreementError` naming every round where some answer differed."""
    bad = []
    for record in rounds:
        names = disagreeing(round_outputs(record))
        if names:
            bad.append(
                f"{record['model']} {record['prompt_tokens']} tokens round "
                f"{record['round']}: {', '.join(names)}"
            )
    if bad:
        raise DisagreementError("greedy tokens differ from recompute: " + "; ".join(bad))


def distribution(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
    }


def summarize_cell(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """TTFT per arm, storage tokens, and the paired ratios of one (model, length) cell."""
    timed = [r for r in rounds if not r["warmup"]]
    if not timed:
        raise ValueError("no timed rounds in the cell")
    arms = {}
    for arm in ARMS:
        answers = [r["arms"][arm] for r in timed]
        arms[arm] = {
            "ttft_s": distribution([a["ttft_s"] for a in answers]),
            "storage_tokens": sorted({a["storage_tokens"] for a in answers}),
            "cached_tokens": sorted({a["cached_tokens"] for a in answers}),
        }
    ratios = {}
    for numerator, denominator in RATIO_PAIRS:
        values = paired_ratios(timed, numerator, denominator)
        ratios[f"{numerator}/{denominator}"] = {**distribution(values), "per_round": values}
    return {"rounds": len(timed), "arms": arms, "paired_ttft_ratio": ratios}


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text scrape, keyed ``name{labels}`` exactly as written."""
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        try:
            samples[name + (labels or "")] = float(value)
        except ValueError:
            continue
    return samples


def metric_delta(
    before: Mapping[str, float], after: Mapping[str, float], prefixes: Sequence[str]
) -> dict[str, float]:
    """How much each sample whose name starts with one of ``prefixes`` grew (non-zero only)."""
    delta = {}
    for key, value in after.items():
        if key.startswith(tuple(prefixes)):
            grown = value - before.get(key, 0.0)
            if grown:
                delta[key] = grown
    return delta


def mean_deltas(deltas: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The mean growth per request of every sample seen in ``deltas``."""
    if not deltas:
        return {}
    keys = sorted({key for d in deltas for key in d})
    return {key: sum(d.get(key, 0.0) for d in deltas) / len(deltas) for key in keys}


def _summed(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """The sum of every sample of family ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        family, _, rest = key.partition("{")
        if family == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def ttft_parts(per_request: Mapping[str, float], client_ttft_s: float) -> dict[str, float]:
    """Split one arm's mean TTFT into what the scraped metrics can tell apart.

    ``queue_s`` is sglang's queue time, which for a restored request holds the
    whole prefetch (hit query and transfer, then the wait for the scheduler to
    see it done); ``after_queue_s`` is the rest of the server's TTFT: the load
    of restored pages into device memory, the last page's compute and the
    first token. ``hit_query_s`` and ``get_s`` exist only for this backend.
    """
    duration = "mooncake_span_operation_duration_seconds_sum"
    server_ttft_s = _summed(per_request, "sglang:time_to_first_token_seconds_sum")
    queue_s = _summed(per_request, "sglang:queue_time_seconds_sum")
    parts = {
        "client_ttft_s": client_ttft_s,
        "server_ttft_s": server_ttft_s,
        "queue_s": queue_s,
        "after_queue_s": server_ttft_s - queue_s,
        "http_and_stream_s": client_ttft_s - server_ttft_s,
    }
    if any(key.startswith(duration) for key in per_request):
        hit_query_s = _summed(per_request, duration, operation="batch_exists")
        get_s = _summed(per_request, duration, operation="batch_get_v1")
        parts.update(
            hit_query_s=hit_query_s,
            get_s=get_s,
            queue_besides_backend_s=queue_s - hit_query_s - get_s,
            get_bytes=_summed(per_request, "mooncake_span_bytes_total", operation="get"),
        )
    return parts
