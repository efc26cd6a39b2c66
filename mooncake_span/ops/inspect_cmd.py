"""``mooncake-span inspect``: what lives in a Mooncake cluster, per namespace, from the
master's admin API; guard and chain records through the ``probe_worker`` child. What is
exact, sampled or estimated: docs/operating.md, "mooncake-span inspect"."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from mooncake_span.mooncake_settings import MooncakeSettings
from mooncake_span.ops import master_http
from mooncake_span.ops.cli_common import (
    add_connection_args,
    admin_url,
    resolve_native_log,
    resolve_settings,
)
from mooncake_span.ops.probe_worker import probe
from mooncake_span.span.chains import (
    chain_record_key,
    parse_chain_record_key,
    reachable_estimate,
    record_keys,
)
from mooncake_span.span.geometry import classify_pool
from mooncake_span.span.keys import KeySchema, RankTags
from mooncake_span.span.object_layout import (
    NamespaceFacts,
    describe_object_layout,
    parse_guard_key,
    parse_object_key,
)

logger = logging.getLogger(__name__)

OTHER_NAMESPACE = "(not mooncake-span)"
_HTTP_TIMEOUT_S = 5.0
_RECORD_TIMEOUT_S = 15.0


@dataclass
class _Namespace:
    facts: NamespaceFacts | None
    objects: int = 0
    page_keys: set[str] = field(default_factory=set)
    suffixes: dict[str, int] = field(default_factory=dict)
    sample: list[str] = field(default_factory=list)
    # Chain records (span.chains): root page key -> the longest record's length.
    chains: dict[str, int] = field(default_factory=dict)


def _known_namespace(
    namespaces: dict[str, _Namespace], key: str
) -> tuple[_Namespace | None, str | None]:
    """Fast path: a key of a namespace already seen (a prefix has 5 fields, 6 with a tag)."""
    parts = key.split("_", 6)
    for fields in (5, 6):
        if len(parts) > fields:
            ns = namespaces.get("_".join(parts[:fields]))
            if ns is not None and ns.facts is not None:
                return ns, "_".join(parts[fields:])
    return None, None


def scan_keys(
    base_url: str, sample_per_namespace: int
) -> tuple[dict[str, _Namespace], list[str], int]:
    """Stream ``/get_all_keys`` once: namespaces, guard keys, total key count."""
    rng = random.Random(0)
    namespaces: dict[str, _Namespace] = {}
    guard_keys: list[str] = []
    chains: dict[str, dict[str, int]] = {}
    total = 0
    for key in master_http.iter_lines(base_url + "/get_all_keys", _HTTP_TIMEOUT_S):
        total += 1
        if parse_guard_key(key) is not None:
            guard_keys.append(key)
            continue
        record = parse_chain_record_key(key)
        if record is not None:
            roots = chains.setdefault(record[0], {})
            roots[record[1]] = max(roots.get(record[1], 0), record[2])
            continue
        ns, rest = _known_namespace(namespaces, key)
        if ns is None:
            facts, rest = parse_object_key(key) or (None, None)
            name = facts.key_prefix if facts else OTHER_NAMESPACE
            ns = namespaces.get(name)
            if ns is None:
                ns = namespaces[name] = _Namespace(facts)
        ns.objects += 1
        if rest is not None:
            page_key, _, suffix = rest.partition("_")
            ns.page_keys.add(page_key)
            ns.suffixes["_" + suffix] = ns.suffixes.get("_" + suffix, 0) + 1
        # A uniform sample of the namespace's keys in one pass (reservoir sampling).
        if len(ns.sample) < sample_per_namespace:
            ns.sample.append(key)
        else:
            slot = rng.randrange(ns.objects)
            if slot < sample_per_namespace:
                ns.sample[slot] = key
    for prefix, roots in chains.items():
        if prefix in namespaces:
            namespaces[prefix].chains = roots
    return namespaces, guard_keys, total


def _chain_sample(namespaces: dict[str, _Namespace], per_namespace: int) -> list[str]:
    """The record keys to read: the longest record of up to ``per_namespace`` roots
    (a seeded sample) of every namespace that has records."""
    rng = random.Random(0)
    keys = []
    for prefix, ns in namespaces.items():
        roots = sorted(ns.chains)
        for root in rng.sample(roots, min(per_namespace, len(roots))):
            keys.append(chain_record_key(prefix, root, ns.chains[root]))
    return keys


def _reachable(ns: _Namespace, prefix: str, records: dict[str, str | None]) -> dict[str, Any]:
    """How much of the sampled chains a hit query from the root still reaches."""
    texts = [records.get(chain_record_key(prefix, root, n)) for root, n in ns.chains.items()]
    read = [record_keys(text) for text in texts if text]
    return {"chain_records": len(ns.chains), **reachable_estimate(read, ns.page_keys)}


def _bytes(base_url: str, ns: _Namespace, exact: bool) -> dict[str, Any]:
    sizes = [master_http.object_size_bytes(base_url, k, _HTTP_TIMEOUT_S) for k in ns.sample]
    known = [s for s in sizes if s is not None]
    if ns.objects == 0:
        return {"bytes": 0, "bytes_estimated": False, "sampled_objects": 0}
    if not known:
        return {"bytes": None, "bytes_estimated": not exact, "sampled_objects": 0}
    if exact:
        return {"bytes": sum(known), "bytes_estimated": False, "sampled_objects": len(known)}
    return {
        "bytes": round(sum(known) / len(known) * ns.objects),
        "bytes_estimated": len(known) < ns.objects,
        "sampled_objects": len(known),
    }


def _segments(samples: list[tuple[str, dict[str, str], float]]) -> list[dict[str, Any]]:
    segments: dict[str, dict[str, Any]] = {}
    for name, labels, value in samples:
        seg = labels.get("segment")
        if seg is None:
            continue
        entry = segments.setdefault(seg, {"name": seg})
        if name == "segment_total_capacity_bytes":
            entry["capacity_bytes"] = int(value)
        elif name == "segment_allocated_bytes":
            entry["used_bytes"] = int(value)
    for entry in segments.values():
        cap = entry.get("capacity_bytes")
        entry["usage_ratio"] = (entry.get("used_bytes", 0) / cap) if cap else None
    return sorted(segments.values(), key=lambda e: e["name"])


def _master_summary(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, Any]:
    wanted = {
        "master_key_count": "keys",
        "master_allocated_bytes": "allocated_bytes",
        "master_total_capacity_bytes": "capacity_bytes",
        "master_client_count": "clients",
        "master_active_clients": "clients",
    }
    return {
        wanted[name]: int(value) for name, labels, value in samples if name in wanted and not labels
    }


def _guard_record(text: str | None) -> Any:
    """A layout-guard record's content; None when absent or unreadable."""
    # Imported here: the store's modules load numpy, which the CLI does not need to start.
    from mooncake_span.store.layout_guard import GeometryRecord

    try:
        return None if text is None else GeometryRecord.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None


def _namespace_doc(
    name: str,
    ns: _Namespace,
    bytes_info: dict[str, Any],
    blobs: dict[str, str | None],
) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": name, "objects": ns.objects, **bytes_info}
    if ns.facts is None:
        doc["examples"] = ns.sample[:3]
        return doc
    if ns.chains:
        doc["reachable"] = _reachable(ns, name, blobs)
    facts = ns.facts
    doc.update(asdict(facts))
    doc["storage_page_tokens"] = facts.host_page_tokens * facts.pages_per_span
    doc["storage_keys"] = len(ns.page_keys)
    doc["components"] = dict(sorted(ns.suffixes.items()))
    key = next((k for k in blobs if parse_guard_key(k) == (facts.tag, facts.model)), None)
    doc["layout_guard"] = {"key": key, "found": key is not None, "record": None}
    if key is not None and blobs[key]:
        doc["layout_guard"]["record"] = json.loads(blobs[key])
        record, doc["object_layout"] = _guard_record(blobs[key]), None
        if record is not None:
            kinds = {name: classify_pool(name) for name in record.pools}
            layout = describe_object_layout(
                facts, record.pools, kinds, source="inspect", layout_guard_key=key
            )
            _fill_observed_suffixes(layout, ns.suffixes)
            doc["object_layout"] = layout
    return doc


def _fill_observed_suffixes(layout: dict[str, Any], observed: dict[str, int]) -> None:
    """A guard record has no rank scopes; a suffix seen in the keys for exactly one
    rank of a component fills the gap (marked ``suffix_observed``)."""
    for pool in layout["hicache_object_layout"]["pools"]:
        for i, comp in enumerate(pool["components"]):
            seen = [sfx for sfx in observed if sfx.endswith("_" + comp["name"])]
            if comp["suffix"] is None and len(seen) == 1:
                comp["suffix"] = pool["suffixes"][i] = seen[0]
                comp["suffix_observed"] = True


def _facts_from_record(key: str, text: str | None) -> NamespaceFacts | None:
    owner, record = parse_guard_key(key), _guard_record(text)
    if owner is None or record is None:
        return None
    tag, model = owner
    host = record.host_page_tokens
    schema = KeySchema(
        model=model,
        host_page_tokens=host,
        pages_per_span=max(1, record.storage_page_tokens // max(1, host)),
        layout=record.layout,
        kv_dtype=record.kv_dtype,
        ranks=RankTags.from_ranks(tp_rank=0),
        tag=tag,
    )
    return NamespaceFacts.from_schema(schema)


def collect(
    base_url: str,
    *,
    sample_per_namespace: int = 32,
    exact_bytes: bool = False,
    read_records: Any = None,
    chain_sample: int = 32,
) -> dict[str, Any]:
    """The inspect document. ``read_records(keys) -> {key: text|None}`` reads guard and
    chain records; ``chain_sample`` chains per namespace estimate what is reachable."""
    started = time.perf_counter()
    limit = sys.maxsize if exact_bytes else sample_per_namespace
    health = master_http.health(base_url, _HTTP_TIMEOUT_S)
    samples = master_http.master_metrics(base_url, _HTTP_TIMEOUT_S)
    namespaces, guard_keys, total = scan_keys(base_url, limit)
    scanned_s = time.perf_counter() - started
    wanted = [*guard_keys, *_chain_sample(namespaces, chain_sample)]
    blobs: dict[str, str | None] = dict.fromkeys(wanted)
    if wanted and read_records is not None:
        blobs.update(read_records(wanted))
    # Namespaces whose guard record exists but whose objects are gone (or not yet written).
    for key in guard_keys:
        facts = _facts_from_record(key, blobs[key])
        if facts is not None and facts.key_prefix not in namespaces:
            namespaces[facts.key_prefix] = _Namespace(facts)
    docs = [
        _namespace_doc(name, ns, _bytes(base_url, ns, exact_bytes), blobs)
        for name, ns in sorted(namespaces.items(), key=lambda item: -item[1].objects)
    ]
    return {
        "admin_url": base_url,
        "health": health,
        "master": _master_summary(samples),
        "segments": _segments(samples),
        "keys": {"total": total, "mode": "streamed", "scan_s": round(scanned_s, 3)},
        "bytes_mode": "exact" if exact_bytes else f"sampled ({sample_per_namespace} per namespace)",
        "layout_guard_records": sorted(guard_keys),
        "namespaces": docs,
        "elapsed_s": round(time.perf_counter() - started, 3),
    }


def _read_records(
    settings: MooncakeSettings, native_log: str | None, keys: list[str]
) -> dict[str, str | None]:
    reply = probe(settings, timeout_s=_RECORD_TIMEOUT_S, native_log=native_log, read_keys=keys)
    if "error" in reply:
        logger.warning("inspect: layout-guard records unreadable: %s", reply["error"])
    return reply.get("blobs") or {}


def _human_bytes(value: float | None) -> str:
    if value is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_text(doc: dict[str, Any]) -> str:
    master = doc["master"]
    lines = [
        f"master {doc['admin_url']}: role {doc['health'].get('role')}, "
        f"{master.get('keys', '?')} keys, {_human_bytes(master.get('allocated_bytes'))} of "
        f"{_human_bytes(master.get('capacity_bytes'))} used",
        f"keys scanned: {doc['keys']['total']} ({doc['keys']['mode']}, "
        f"{doc['keys']['scan_s']} s); bytes {doc['bytes_mode']}",
        "",
        "segments:",
    ]
    for seg in doc["segments"] or [{"name": "(none mounted)"}]:
        ratio = seg.get("usage_ratio")
        lines.append(
            f"  {seg['name']:<28} {_human_bytes(seg.get('used_bytes')):>10} / "
            f"{_human_bytes(seg.get('capacity_bytes')):>10}"
            + (f"  {ratio:.1%}" if ratio is not None else "")
        )
    lines += ["", "namespaces:"]
    for ns in doc["namespaces"] or [{"name": "(no objects)", "objects": 0, "bytes": 0}]:
        approx = "~" if ns.get("bytes_estimated") else ""
        line = f"  {ns['name']:<48} {ns['objects']:>8} objects {approx}{_human_bytes(ns['bytes'])}"
        if "pages_per_span" in ns:
            guard = ns["layout_guard"]
            line += (
                f"  K={ns['pages_per_span']} x {ns['host_page_tokens']} tokens, "
                f"{ns['storage_keys']} storage keys, guard "
                + ("record" if guard["record"] else "found" if guard["found"] else "none")
            )
            reach = ns.get("reachable")
            if reach and reach["share"] is not None:
                line += f", reachable ~{reach['share']:.0%} ({reach['chains_sampled']} chains)"
        lines.append(line)
    return "\n".join(lines)


def run_inspect_command(args: argparse.Namespace) -> int:
    settings = None
    try:
        settings, extra = resolve_settings(args)
        base = admin_url(args, settings, extra)
    except ValueError as exc:
        if not args.admin_url:
            print(f"mooncake-span inspect: {exc}", file=sys.stderr)
            return 2
        if not args.no_records:
            logger.warning("inspect: not reading layout-guard records: %s", exc)
        base = args.admin_url.rstrip("/")
    if base is None:
        print(
            "mooncake-span inspect: an etcd:// master has no single admin server; pass "
            "--admin-url http://LEADER_HOST:METRICS_PORT",
            file=sys.stderr,
        )
        return 2
    read_records = None
    if settings is not None and not args.no_records:
        native_log = resolve_native_log(args.native_log, "inspect")
        read_records = functools.partial(_read_records, settings, native_log)
    try:
        doc = collect(
            base,
            sample_per_namespace=args.sample,
            exact_bytes=args.exact_bytes,
            read_records=read_records,
            chain_sample=args.chains,
        )
    except master_http.AdminError as exc:
        print(f"mooncake-span inspect: the master's admin server: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=1) if args.json else format_text(doc), flush=True)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="namespaces, objects, bytes and segments of a Mooncake cluster",
        description=(
            "List the cluster's namespaces (model, tag, span geometry from the key prefixes and "
            "the layout-guard records), objects, storage keys and bytes per namespace, segments "
            "with capacity and usage, and the master's totals, from the master's HTTP admin API. "
            "Keys are streamed; bytes are sampled per namespace unless --exact-bytes."
        ),
    )
    add_connection_args(parser)
    parser.add_argument(
        "--sample",
        type=int,
        default=32,
        metavar="N",
        help="objects per namespace whose size is queried to estimate bytes (default 32)",
    )
    parser.add_argument(
        "--exact-bytes",
        action="store_true",
        help="query every object's size (one HTTP request per key: slow on big stores)",
    )
    parser.add_argument(
        "--chains",
        type=int,
        default=32,
        metavar="N",
        help="chain records read per namespace to estimate the share of stored keys a hit "
        "query can reach (default 32; the backend keeps records of a sample of chains, "
        "span_chain_sample_every)",
    )
    parser.add_argument(
        "--no-records",
        action="store_true",
        help="do not start a store client to read layout-guard records",
    )
    parser.set_defaults(func=run_inspect_command)
