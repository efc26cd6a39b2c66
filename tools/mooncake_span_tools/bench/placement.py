"""``mooncake-span bench --placement``: what one dead storage node costs, by placement.

Three contenders share one cluster of N storage nodes (N = 2 and 4), each in
its own key namespace, writing the same pages:

* ``per_key``: MooncakeSpanStore as today without prefix keys: every storage
  key on the segment rendezvous hashing picks for that key;
* ``chain``: the same backend, every backup, hit query and prefetch carrying
  ``prefix_keys`` as sglang does with ``hicache_storage_pass_prefix_keys``;
* ``upstream``: sglang 0.5.23's ``MooncakeStore`` (Mooncake places each object).

``CONVERSATIONS`` two-turn conversations of sglang-shaped page keys (chained
SHA-256 hex digests of the tokens, ``get_storage_hash_str``) are backed up
turn by turn with ``batch_set_v1`` in batches of ``STORAGE_BATCH_SIZE`` keys,
as sglang's controller calls it, then read back whole (``batch_exists``, then
``batch_get_v1``). The contenders take turns per conversation, in alternating
order, so their put and get times are paired. Bytes per node come from where
the master says each object is (``batch_get_replica_desc``).

Then one storage node is SIGKILLed, the master drops it (``client_ttl``), and
every conversation is hit-queried and prefetched from its first token. Its
restorable tokens are the leading pages that came back byte-exact (a page
reported restored with other bytes is counted as wrong). Each node of each N
is the victim once, on a fresh cluster, so the share is reported for every
victim and as their mean (the expected cost of losing one node).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
from mooncake_span.store.domains import ChainSpot, put_targets
from mooncake_span.store.segments import fetch_segments, replica_segments
from mooncake_span_tools.bench.shared_native import RecordingNative, Topology
from mooncake_span_tools.bench.workloads import BenchConfig
from mooncake_span_tools.testing import pools as P
from mooncake_span_tools.testing.backends import span_backend, storage_config, upstream_backend

logger = logging.getLogger(__name__)

_PAGE_KEY = re.compile(r"[0-9a-f]{64}")  # sglang's page hash inside any object key

CONTENDERS = ("per_key", "chain", "upstream")
NODE_COUNTS = (2, 4)
CONVERSATIONS = 64
PAGE_TOKENS = 64
# Turn lengths in pages: a conversation is 3 to 10 pages (192 to 640 tokens),
# all inside the default 32k-token chain window.
FIRST_TURN_PAGES = (2, 6)
SECOND_TURN_PAGES = (1, 4)
MAX_PAGES = FIRST_TURN_PAGES[1] + SECOND_TURN_PAGES[1]
# An MLA page of 4 layers x 64 tokens x (256 + 32) bf16 values: 147,456 bytes.
MLA_SHAPE = {"layers": 4, "kv_lora_rank": 256, "rope_dim": 32}
SEGMENT_BYTES = 512 << 20  # per storage node: the three namespaces never fill it
CLIENT_TTL_S = 2
# The share floors of issue 25 (1 of 2 nodes lost, 1 of 4), and the balance bound.
SHARE_FLOORS = {2: 0.45, 4: 0.70}
BALANCE_BOUND = 0.25


@dataclass
class Conversation:
    keys: list[str]
    turns: list[int]  # keys per backup call
    seed: int

    @property
    def tokens(self) -> int:
        return PAGE_TOKENS * len(self.keys)


def conversations(seed: int, count: int = CONVERSATIONS) -> list[Conversation]:
    """``count`` two-turn conversations with sglang's own page hashes."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    rng = random.Random(seed)
    out = []
    for c in range(count):
        turns = [rng.randint(*FIRST_TURN_PAGES), rng.randint(*SECOND_TURN_PAGES)]
        tokens = [rng.randrange(1 << 20) for _ in range(sum(turns) * PAGE_TOKENS)]
        keys = list(get_storage_hash_str(tokens, None, page_size=PAGE_TOKENS))
        out.append(Conversation(keys, turns, seed * 1000 + c))
    return out


@dataclass
class Tally:
    """One contender on one cluster: times, placement and what survived."""

    put_s: float = 0.0
    get_s: float = 0.0
    pages_put: int = 0
    pages_read: int = 0
    stored_tokens: int = 0
    restorable_tokens: int = 0
    wrong_pages: int = 0
    object_keys: dict[str, int] = field(default_factory=dict)  # object key -> bytes
    bytes_per_node: dict[str, int] = field(default_factory=dict)
    # Per segment: the restorable share if it alone died, from where objects are.
    if_lost: dict[str, float] = field(default_factory=dict)


def _info(contender: str, prefix: list[str]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    # sglang with the knob off passes prefix_keys=None; upstream ignores them.
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix) if contender == "chain" else None)


def _slots(first_page: int, count: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE_TOKENS, (first_page + count) * PAGE_TOKENS)


def _page_digest(kv: Any, page: int) -> str:
    return hashlib.sha256(P.page_bytes(kv, page * PAGE_TOKENS)).hexdigest()


class Rig:
    """One cluster, its shared client, one MLA host pool and the three contenders."""

    def __init__(self, nodes: int, nonce: str) -> None:
        self.nodes = nodes
        self.nonce = nonce
        self.cluster: LocalCluster | None = None
        self.topology: Topology | None = None
        self.native: RecordingNative | None = None
        self.kv = P.build_mla_host("page_first", host_pages=2 * MAX_PAGES, **MLA_SHAPE)
        self.stores: dict[str, Any] = {}
        self.tallies = {name: Tally() for name in CONTENDERS}

    def __enter__(self) -> Rig:
        spec = ClusterSpec(
            storage_nodes=self.nodes,
            storage_node_segment_bytes=SEGMENT_BYTES,
            client_ttl_s=CLIENT_TTL_S,
        )
        self.cluster = LocalCluster(spec).start()
        try:
            self.segments = wait_for_segments(self.cluster.metrics_url, self.nodes)
            config = BenchConfig(
                master_server_address=self.cluster.master_address,
                metadata_server=self.cluster.metadata_server,
                progress=False,
            )
            self.topology = Topology("remote", config).__enter__()
            self.native = RecordingNative(self.topology.native)
            for name in CONTENDERS:
                self.stores[name] = self._make(name)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _extra(self) -> dict[str, Any]:
        return {
            **self.cluster.client_config(),
            "span_layout_guard": "off",
            "storage_page_size": PAGE_TOKENS,
            "span_master_admin_url": self.cluster.metrics_url,
        }

    def _make(self, name: str) -> Any:
        config = storage_config(self._extra(), f"place-{name}-{self.nonce}")
        pools = {P.PoolName.KV: self.kv}
        if name == "upstream":
            return upstream_backend(config, pools, self.native)
        return span_backend(config, pools, self.native)

    def __exit__(self, *exc: object) -> None:
        for store in self.stores.values():
            with contextlib.suppress(Exception):
                store.close()
        self.stores.clear()
        if self.native is not None:
            with contextlib.suppress(Exception):
                self.native.unregister_all()
        if self.topology is not None:
            self.topology.__exit__(None, None, None)
            self.topology = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    # ---- one conversation, one contender ------------------------------------------

    def backup(self, name: str, conv: Conversation) -> list[str]:
        """The conversation's turns, each as the controller backs it up; the
        digest of every page written."""
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

        P.fill_random_pages(
            self.kv, [p * PAGE_TOKENS for p in range(len(conv.keys))], seed=conv.seed
        )
        store, tally = self.stores[name], self.tallies[name]
        self.native.stored.clear()
        done = 0
        for turn in conv.turns:
            for start in range(done, done + turn, STORAGE_BATCH_SIZE):
                stop = min(start + STORAGE_BATCH_SIZE, done + turn)
                started = time.perf_counter()
                ok = store.batch_set_v1(
                    conv.keys[start:stop],
                    _slots(start, stop - start),
                    _info(name, conv.keys[:start]),
                )
                tally.put_s += time.perf_counter() - started
                if not all(ok):
                    raise RuntimeError(f"{name}: a backup of {stop - start} pages failed")
            done += turn
        tally.object_keys.update(self.native.stored)
        tally.pages_put += len(conv.keys)
        tally.stored_tokens += conv.tokens
        return [_page_digest(self.kv, p) for p in range(len(conv.keys))]

    def restore(self, name: str, conv: Conversation, expected: list[str]) -> tuple[int, int]:
        """(restorable pages from the first token, pages reported restored with wrong bytes)."""
        store = self.stores[name]
        info = _info(name, [])
        hits = store.batch_exists(conv.keys, info)
        if not hits:
            return 0, 0
        base = MAX_PAGES
        P.wipe_pages(self.kv, [(base + p) * PAGE_TOKENS for p in range(hits)])
        flags = store.batch_get_v1(conv.keys[:hits], _slots(base, hits), info)
        good = wrong = 0
        for p, ok in enumerate(flags):
            if not ok:
                break
            if _page_digest(self.kv, base + p) != expected[p]:
                wrong += 1
                break
            good += 1
        return good, wrong

    def locate(self, name: str, convs: list[Conversation]) -> None:
        """Where the master says the contender's objects are: bytes per node, and
        per node the restorable tokens if that node alone died (each conversation
        up to its first page with an object there)."""
        tally = self.tallies[name]
        keys = list(tally.object_keys)
        located = replica_segments(self.native.batch_get_replica_desc(keys))
        tally.bytes_per_node = dict.fromkeys(self.segments, 0)
        homes: dict[str, set[str]] = {}
        for key in keys:
            page_key = _PAGE_KEY.search(key).group(0)
            for segment in located.get(key, ()):
                tally.bytes_per_node[segment] = (
                    tally.bytes_per_node.get(segment, 0) + (tally.object_keys[key])
                )
                homes.setdefault(page_key, set()).add(segment)
        kept = dict.fromkeys(self.segments, 0)
        for conv in convs:
            for segment in self.segments:
                cut = next(
                    (i for i, k in enumerate(conv.keys) if segment in homes.get(k, ())),
                    len(conv.keys),
                )
                kept[segment] += cut * PAGE_TOKENS
        tally.if_lost = {s: round(v / tally.stored_tokens, 4) for s, v in kept.items()}


def wait_for_segments(admin_url: str, count: int, timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while len(found := fetch_segments(admin_url) or []) != count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the master did not list {count} segments in {timeout_s:.0f}s")
        time.sleep(0.1)
    return sorted(found)


def node_of_segment(cluster: LocalCluster, nodes: int, segment: str) -> int:
    """The storage node that printed ``segment`` in its READY line."""
    for i in range(nodes):
        if f"segment={segment}" in (cluster.log_dir / f"node{i}.log").read_text(errors="replace"):
            return i
    raise RuntimeError(f"no storage node printed segment {segment}")


# ---- one cluster per (node count, victim) ---------------------------------------------


def _paired(index: int) -> tuple[str, ...]:
    """Contender order for conversation ``index``: alternating, so no one always goes first."""
    return CONTENDERS if index % 2 == 0 else CONTENDERS[::-1]


def _write_and_read(rig: Rig, convs: list[Conversation]) -> list[list[str]]:
    """Every conversation backed up, then read back whole (timed), by every contender."""
    expected = [[] for _ in convs]
    for i, conv in enumerate(convs):
        for name in _paired(i):
            expected[i] = rig.backup(name, conv)
    for i, conv in enumerate(convs):
        for name in _paired(i):
            tally = rig.tallies[name]
            started = time.perf_counter()
            good, wrong = rig.restore(name, conv, expected[i])
            tally.get_s += time.perf_counter() - started
            tally.pages_read += good
            tally.wrong_pages += wrong
            if good != len(conv.keys):
                raise RuntimeError(f"{name}: read back {good} of {len(conv.keys)} pages")
    return expected


def _balance(bytes_per_node: dict[str, int]) -> dict[str, float]:
    mean = sum(bytes_per_node.values()) / len(bytes_per_node)
    return {
        "max_dev_from_mean": round(max(bytes_per_node.values()) / mean - 1, 4),
        "min_dev_from_mean": round(min(bytes_per_node.values()) / mean - 1, 4),
    }


def _figures(tally: Tally) -> dict[str, Any]:
    out = {
        "stored_tokens": tally.stored_tokens,
        "restorable_tokens": tally.restorable_tokens,
        "restorable_share": round(tally.restorable_tokens / tally.stored_tokens, 4),
        "wrong_pages": tally.wrong_pages,
        "predicted_share_by_victim": tally.if_lost,
        "predicted_mean_share": round(statistics.mean(tally.if_lost.values()), 4),
        "bytes_per_node": tally.bytes_per_node,
        **_balance(tally.bytes_per_node),
        "put_pages_per_s": round(tally.pages_put / tally.put_s, 1),
        "get_pages_per_s": round(tally.pages_read / tally.get_s, 1),
    }
    return out


def run_one(nodes: int, victim: int, convs: list[Conversation], nonce: str) -> dict[str, Any]:
    """A fresh cluster of ``nodes``: write, read, SIGKILL the ``victim``-th segment's
    node, wait until the master drops it, restore every conversation."""
    with Rig(nodes, nonce) as rig:
        expected = _write_and_read(rig, convs)
        for name in CONTENDERS:
            rig.locate(name, convs)
        dead = rig.segments[victim]
        rig.cluster.kill_storage_node(node_of_segment(rig.cluster, nodes, dead))
        wait_for_segments(rig.cluster.metrics_url, nodes - 1)
        for name in CONTENDERS:
            tally = rig.tallies[name]
            for conv, digests in zip(convs, expected, strict=True):
                good, wrong = rig.restore(name, conv, digests)
                tally.restorable_tokens += good * PAGE_TOKENS
                tally.wrong_pages += wrong
        figures = {name: _figures(rig.tallies[name]) for name in CONTENDERS}
    return {"nodes": nodes, "victim": dead, "contenders": figures}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per contender over the runs of one node count: shares, balance, throughput."""
    out: dict[str, Any] = {}
    for name in CONTENDERS:
        cells = [run["contenders"][name] for run in runs]
        shares = [c["restorable_share"] for c in cells]
        predicted = [
            run["contenders"][name]["predicted_share_by_victim"][run["victim"]] for run in runs
        ]
        out[name] = {
            "mean_share_over_victims": round(statistics.mean(shares), 4),
            "predicted_mean_share_over_victims": round(
                statistics.mean(c["predicted_mean_share"] for c in cells), 4
            ),
            "measured_equals_predicted": all(
                abs(m - p) < 1e-3 for m, p in zip(shares, predicted, strict=True)
            ),
            "min_share": min(shares),
            "max_share": max(shares),
            "worst_max_dev_from_mean": max(c["max_dev_from_mean"] for c in cells),
            "worst_min_dev_from_mean": min(c["min_dev_from_mean"] for c in cells),
            "wrong_pages": sum(c["wrong_pages"] for c in cells),
        }
    for op in ("put", "get"):
        ratios = [
            run["contenders"]["chain"][f"{op}_pages_per_s"]
            / run["contenders"]["per_key"][f"{op}_pages_per_s"]
            for run in runs
        ]
        out[f"chain_over_per_key_{op}"] = {
            "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
        }
    return out


# ---- the window, modelled with the placement rule itself --------------------------------

MODEL_WINDOWS_KEYS = (2, 3, 4, 6, 8, 512)  # 512 keys = the default 32k tokens / 64
MODEL_TRIALS = 200


def _model_trial(convs: list[Conversation], segments: list[str], window_keys: int):
    """Pages per segment, and per segment the restorable pages if it dies."""
    pages = dict.fromkeys(segments, 0)
    kept = dict.fromkeys(segments, 0)
    for conv in convs:
        spot = ChainSpot(f"model_{conv.keys[0]}", 0, window_keys)
        domains, steps = spot.objects(range(len(conv.keys)), 1)
        targets = put_targets(conv.keys, domains, segments, 1, frozenset(), steps)
        first = {seg: min(i for i, _ in entries) for seg, entries in targets.items()}
        for seg, entries in targets.items():
            pages[seg] += len(entries)
        for seg in segments:
            kept[seg] += first.get(seg, len(conv.keys))
    return pages, kept


def window_model(convs: list[Conversation], nodes: int, window_keys: int) -> dict[str, Any]:
    """Over ``MODEL_TRIALS`` random segment sets: the mean restorable share after one
    node dies (every node a victim in turn), the median worst deviation of pages
    per node from the mean, and how often every node is within BALANCE_BOUND."""
    total = sum(len(c.keys) for c in convs)
    shares, devs = [], []
    for trial in range(MODEL_TRIALS):
        segments = [f"10.{trial // 250}.{trial % 250}.{i}:15000" for i in range(nodes)]
        pages, kept = _model_trial(convs, segments, window_keys)
        shares.append(sum(kept.values()) / nodes / total)
        mean = total / nodes
        devs.append(max(abs(p / mean - 1) for p in pages.values()))
    return {
        "window_keys": window_keys,
        "window_tokens": window_keys * PAGE_TOKENS,
        "mean_share": round(statistics.mean(shares), 4),
        "median_worst_dev": round(statistics.median(devs), 4),
        "within_bound": round(sum(d <= BALANCE_BOUND for d in devs) / len(devs), 3),
    }


def run_placement(quick: bool = False, seed: int = 25) -> dict[str, Any]:
    nonce = str(time.time_ns())
    convs = conversations(seed, 16 if quick else CONVERSATIONS)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "conversations": len(convs),
        "page_tokens": PAGE_TOKENS,
        "page_bytes": len(
            P.page_bytes(P.build_mla_host("page_first", host_pages=1, **MLA_SHAPE), 0)
        ),
        "turn_pages": [FIRST_TURN_PAGES, SECOND_TURN_PAGES],
        "stored_tokens": sum(c.tokens for c in convs),
        "seed": seed,
        "by_nodes": {},
    }
    for nodes in NODE_COUNTS:
        victims = [0] if quick else list(range(nodes))
        runs = []
        for victim in victims:
            logger.info("placement: %d nodes, victim %d", nodes, victim)
            runs.append(run_one(nodes, victim, convs, f"{nonce}-{nodes}-{victim}"))
        result["by_nodes"][str(nodes)] = {"runs": runs, "summary": _summary(runs)}
    result["window_model"] = {
        str(n): [window_model(convs, n, w) for w in MODEL_WINDOWS_KEYS] for n in NODE_COUNTS
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def format_placement(result: dict[str, Any]) -> str:
    lines = [
        f"{result['conversations']} conversations, {result['stored_tokens']} prompt tokens; "
        "restorable share after one node is SIGKILLed (mean over victims [min, max]), "
        "bytes per node (worst max/min deviation from the mean)"
    ]
    for nodes, section in result["by_nodes"].items():
        summary = section["summary"]
        for name in CONTENDERS:
            f = summary[name]
            lines.append(
                f"  {nodes} nodes {name:9s} share {f['mean_share_over_victims']:.3f} "
                f"[{f['min_share']:.3f}, {f['max_share']:.3f}] (placement: "
                f"{f['predicted_mean_share_over_victims']:.3f}, measured as predicted "
                f"{f['measured_equals_predicted']})  bytes "
                f"{f['worst_max_dev_from_mean']:+.3f}/{f['worst_min_dev_from_mean']:+.3f}  "
                f"wrong {f['wrong_pages']}"
            )
        for op in ("put", "get"):
            r = summary[f"chain_over_per_key_{op}"]
            lines.append(
                f"  {nodes} nodes chain/per_key {op} pages/s {r['median']:.3f} "
                f"[{r['min']:.3f}, {r['max']:.3f}]"
            )
    lines.append("window model (mean share / median worst byte deviation / within 25%):")
    for nodes, cells in result["window_model"].items():
        row = "  ".join(
            f"{c['window_keys']}k {c['mean_share']:.3f}/{c['median_worst_dev']:.3f}/"
            f"{c['within_bound']:.2f}"
            for c in cells
        )
        lines.append(f"  {nodes} nodes  {row}")
    return "\n".join(lines)


def run_placement_command(quick: bool, json_path: str | None) -> int:
    import json

    result = run_placement(quick)
    print(format_placement(result), flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {json_path}", flush=True)
    return 0
