"""The SSD tier with real servers: ``mooncake-span bench --serve --serve-workloads ssd``.

Three parts, each on servers and clusters of its own (tiny llama, CPU):

* **TTFT from SSD vs DRAM** (paired rounds). One cluster whose storage node
  has an SSD tier; a writer, a reader and a recompute server. Each round the
  writer answers a fresh prompt, the storage node restarts (gracefully: the
  new node registers the prompt's objects from disk, so they are on SSD
  only), the writer answers a second fresh prompt (its objects in DRAM, and on
  disk), and the reader, its caches flushed, answers both and recompute
  answers too, in an order that rotates every round. The figure is the
  per-round ratio of the reader's TTFT on the SSD prompt to the DRAM prompt.
* **Multi-turn past DRAM** (``serve_multiturn.py``'s workload): the L3 arms'
  clusters hold ``small_dram_bytes`` of DRAM, a quarter or less of the
  working set, except the reference ``span-dram-all`` with enough DRAM for
  everything. ``span-dram``: this backend, DRAM only; ``span-ssd``: the same
  DRAM with an SSD tier on the storage node (``--ssd-dir``); ``mooncake-ssd``:
  sglang's ``MooncakeStore`` set up as Mooncake's SSD-offload guide and sglang
  say (the server owns the segment, ``enable_ssd_offload`` and
  ``ssd_offload_path`` in its extra-config, the master with
  ``--enable_offload=true``, Mooncake's defaults otherwise). L3 hit rate (the
  share of prompt tokens restored from storage) and input throughput per arm.
* **Restore after a whole-cluster restart**: per L3 arm (``span-ssd``,
  ``span-dram``, ``mooncake-ssd``) one server answers ``restart_prompts``
  prompts and then, its caches flushed, restores each from L3 (the tokens
  stored before). Servers, storage nodes and masters all stop; a new cluster
  on new ports (the same SSD directories) and a new server restore the same
  prompts: restored over stored tokens, and every answer against recompute.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_span.ops.cluster import LocalCluster
from mooncake_span.ops.cluster_spec import (
    CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO,
    CLUSTER_UP_EVICTION_RATIO,
    CLUSTER_UP_LEASE_TTL_MS,
    ClusterSpec,
)
from mooncake_span_tools.bench import serve_arms as A
from mooncake_span_tools.bench import serve_multiturn as M
from mooncake_span_tools.bench import serve_stats as S
from mooncake_span_tools.lab.sglang_servers import ServerOptions, SglangServer
from mooncake_span_tools.testing.cpu_server.models import ensure_model

logger = logging.getLogger(__name__)

RECOMPUTE = S.RECOMPUTE
SPAN_ALL = "span-dram-all"
SPAN_DRAM = "span-dram"
SPAN_SSD = "span-ssd"
MOONCAKE_SSD = "mooncake-ssd"
MULTITURN_ARMS = (RECOMPUTE, SPAN_ALL, SPAN_DRAM, SPAN_SSD, MOONCAKE_SSD)
RESTART_ARMS = (SPAN_SSD, SPAN_DRAM, MOONCAKE_SSD)
# Mooncake's default offload heartbeat: what mooncake-ssd gets to write before a restart.
MOONCAKE_HEARTBEAT_S = 10.0
OFFLOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SsdServeConfig(M.MultiTurnConfig):
    # The DRAM of every L3 arm but the reference (its storage node, or mooncake-ssd's server).
    small_dram_bytes: int = 128 << 20
    ttft_rounds: int = 6
    ttft_prompt_tokens: int = 2048
    restart_prompts: int = 6
    restart_prompt_tokens: int = 1024

    def __post_init__(self) -> None:
        super().__post_init__()
        working_set_bytes = self.working_set_tokens * A.kv_bytes_per_token(
            self.model_spec(self.model)
        )
        if working_set_bytes < 4 * self.small_dram_bytes:
            raise ValueError(
                f"the working set ({working_set_bytes} bytes) must be at least 4x the small "
                f"arms' DRAM ({self.small_dram_bytes} bytes): add clients or lower it"
            )

    @property
    def ssd_root(self) -> Path:
        return self.work_dir / "ssd"


# ---- arms ---------------------------------------------------------------------------


def arm_spec(arm: str, config: SsdServeConfig, log_dir: Path, tag: str) -> ClusterSpec:
    """One L3 arm's cluster, as its operator would start it."""
    common = {"log_dir": log_dir / f"cluster-{arm}-{tag}"}
    if arm == MOONCAKE_SSD:  # the server owns the segment; offload needs the master's flag
        return ClusterSpec(storage_nodes=0, master_extra_args=("--enable_offload=true",), **common)
    if arm == SPAN_SSD:
        ssd_dir = config.ssd_root / tag / arm
        ssd_dir.mkdir(parents=True, exist_ok=True)
        return ClusterSpec(
            storage_nodes=1,
            storage_node_segment_bytes=config.small_dram_bytes,
            ssd_dir=ssd_dir,
            **common,
        )
    return ClusterSpec(
        storage_nodes=1,
        storage_node_segment_bytes=config.segment_bytes
        if arm == SPAN_ALL
        else config.small_dram_bytes,
        lease_ttl_ms=CLUSTER_UP_LEASE_TTL_MS,
        eviction_high_watermark_ratio=CLUSTER_UP_EVICTION_HIGH_WATERMARK_RATIO,
        eviction_ratio=CLUSTER_UP_EVICTION_RATIO,
        **common,
    )


def arm_server(
    arm: str,
    model_path: Path,
    cluster: LocalCluster | None,
    config: SsdServeConfig,
    tag: str,
    **fields: Any,
) -> ServerOptions:
    if arm == RECOMPUTE:
        return A.arm_options(RECOMPUTE, model_path, None, **fields)
    if arm != MOONCAKE_SSD:
        return A.arm_options(S.SPAN, model_path, cluster, **fields)
    storage = {
        k: v for k, v in cluster.client_config(config.small_dram_bytes).items() if "span_" not in k
    }
    ssd_dir = config.ssd_root / tag / arm
    ssd_dir.mkdir(parents=True, exist_ok=True)
    storage.update(enable_ssd_offload=True, ssd_offload_path=str(ssd_dir))
    options = A.arm_options(S.MOONCAKE, model_path, cluster, **fields)
    return dataclasses.replace(options, storage_config=storage)


def start_arms(
    arms: Sequence[str],
    config: SsdServeConfig,
    stack: ExitStack,
    log_dir: Path,
    tag: str,
    max_total_tokens: int,
) -> tuple[dict[str, SglangServer], dict[str, LocalCluster]]:
    model_path = ensure_model(config.model_spec(config.model), config.work_dir / "models")
    clusters = {
        arm: stack.enter_context(LocalCluster(arm_spec(arm, config, log_dir, tag)))
        for arm in arms
        if arm != RECOMPUTE
    }
    servers = {}
    for arm in arms:
        options = arm_server(
            arm,
            model_path,
            clusters.get(arm),
            config,
            tag,
            **config.server_fields(max_total_tokens),
        )
        servers[arm] = SglangServer(f"ssd-{tag}-{arm}", options, log_dir)
        stack.callback(servers[arm].stop)
    servers = A.start_servers(servers, log_dir, stack)
    for server in servers.values():
        server.warm_up()
    return servers, clusters


# ---- TTFT from SSD vs DRAM -------------------------------------------------------------


def _ttft_round(
    servers: Mapping[str, SglangServer],
    cluster: LocalCluster,
    config: SsdServeConfig,
    index: int,
) -> dict[str, Any]:
    prompts = {
        tier: A.round_prompt(config.seed, f"ssd-{tier}", config.ttft_prompt_tokens, index)
        for tier in ("ssd", "dram")
    }
    min_keys = config.ttft_prompt_tokens // config.page_size_tokens - 1
    writer = servers["writer"]
    before = A.stored_keys(cluster)
    writer.generate(prompts["ssd"], config.answer_tokens)
    A.wait_for_backup(cluster, before, min_keys)
    _wait_on_disk(cluster, A.stored_keys(cluster) - before)
    cluster.restart_storage_node(0)  # graceful: the new node registers them from disk only
    before = A.stored_keys(cluster)
    writer.generate(prompts["dram"], config.answer_tokens)
    A.wait_for_backup(cluster, before, min_keys)
    for server in servers.values():
        server.flush_cache()
    reads = {}
    order = S.round_order(("ssd", "dram", RECOMPUTE), index)
    for what in order:
        # The reader restores each prompt; recompute answers the DRAM one as a reference.
        server = servers[RECOMPUTE if what == RECOMPUTE else "reader"]
        prompt = prompts["dram" if what == RECOMPUTE else what]
        ttft_s, answer = A.stream_generate(server.url, prompt, config.answer_tokens)
        reads[what] = {
            "ttft_s": ttft_s,
            "storage_tokens": answer.storage_tokens,
            "output_ids": list(answer.output_ids),
        }
        time.sleep(0.5)  # the server that answered still writes its pages to host memory
    wrong = _disagreeing_reads(reads, prompts, servers[RECOMPUTE], config)
    record = {"round": index, "order": list(order), "reads": reads, "disagreeing": wrong}
    print(
        f"ssd ttft round {index}: "
        + " ".join(f"{k}={v['ttft_s']:.2f}s/{v['storage_tokens']}" for k, v in reads.items()),
        file=sys.stderr,
        flush=True,
    )
    return record


def _disagreeing_reads(
    reads: Mapping[str, Any],
    prompts: Mapping[str, list[int]],
    recompute: SglangServer,
    config: SsdServeConfig,
) -> list[str]:
    """The reads whose greedy answer differs from a server that recomputes."""
    bad = []
    for tier in ("ssd", "dram"):
        recompute.flush_cache()
        want = list(recompute.generate(prompts[tier], config.answer_tokens).output_ids)
        if reads[tier]["output_ids"] != want:
            bad.append(tier)
    return bad


def _wait_on_disk(cluster: LocalCluster, objects: set[str]) -> float:
    """Until every object has a replica on the storage node's SSD (bounded)."""
    from mooncake_span_tools.bench.shared_native import raw_client

    store = raw_client(cluster.client_config())
    started = time.monotonic()
    try:
        while time.monotonic() - started < OFFLOAD_TIMEOUT_S:
            found = store.batch_get_replica_desc(sorted(objects))
            if sum(any(r.is_local_disk_replica() for r in v) for v in found.values()) >= len(
                objects
            ):
                return time.monotonic() - started
            time.sleep(0.25)
    finally:
        store.close()
    raise RuntimeError(f"{len(objects)} objects did not all reach the SSD")


def run_ttft(config: SsdServeConfig) -> dict[str, Any]:
    log_dir = config.work_dir / "logs" / "ssd-ttft"
    with ExitStack() as stack:
        cluster = stack.enter_context(
            LocalCluster(
                ClusterSpec(
                    storage_nodes=1,
                    storage_node_segment_bytes=config.segment_bytes,
                    ssd_dir=_fresh(config.ssd_root / "ttft"),
                    log_dir=log_dir / "cluster",
                )
            )
        )
        model_path = ensure_model(config.model_spec(config.model), config.work_dir / "models")
        fields = config.server_fields(2 * config.ttft_prompt_tokens + 1024)
        servers = {
            role: SglangServer(
                f"ssd-ttft-{role}",
                A.arm_options(
                    RECOMPUTE if role == RECOMPUTE else S.SPAN, model_path, cluster, **fields
                ),
                log_dir,
            )
            for role in ("writer", "reader", RECOMPUTE)
        }
        for server in servers.values():
            stack.callback(server.stop)
        servers = A.start_servers(servers, log_dir, stack)
        rounds = [_ttft_round(servers, cluster, config, i) for i in range(config.ttft_rounds + 1)]
    timed = rounds[1:]  # round 0 warms every path up
    ratios = [r["reads"]["ssd"]["ttft_s"] / r["reads"]["dram"]["ttft_s"] for r in timed]
    return {
        "prompt_tokens": config.ttft_prompt_tokens,
        "rounds": rounds,
        "ttft_s": {
            what: S.distribution([r["reads"][what]["ttft_s"] for r in timed])
            for what in ("ssd", "dram", RECOMPUTE)
        },
        "storage_tokens": {
            what: [r["reads"][what]["storage_tokens"] for r in timed] for what in ("ssd", "dram")
        },
        "ssd_over_dram": {**S.distribution(ratios), "per_round": ratios},
        "disagreeing": [
            f"round {r['round']}: {r['disagreeing']}" for r in rounds if r["disagreeing"]
        ],
    }


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


# ---- multi-turn past DRAM --------------------------------------------------------------


def run_ssd_multiturn(config: SsdServeConfig) -> dict[str, Any]:
    log_dir = config.work_dir / "logs" / "ssd-multiturn"
    _fresh(config.ssd_root / "multiturn")
    spec = config.model_spec(config.model)
    result: dict[str, Any] = {
        "arms_order": list(MULTITURN_ARMS),
        "working_set_tokens": config.working_set_tokens,
        "working_set_bytes": config.working_set_tokens * A.kv_bytes_per_token(spec),
        "small_dram_bytes": config.small_dram_bytes,
        "full_dram_bytes": config.segment_bytes,
        "turns": [],
    }
    with ExitStack() as stack:
        servers, clusters = start_arms(
            MULTITURN_ARMS, config, stack, log_dir, "multiturn", config.device_tokens
        )
        histories = {arm: [[] for _ in range(config.clients)] for arm in MULTITURN_ARMS}
        for turn in range(config.turns):
            result["turns"].append(_multiturn_turn(config, servers, clusters, histories, turn))
    result["arms"] = {arm: M.summarize_arm(result["turns"], arm) for arm in MULTITURN_ARMS}
    result["disagreeing"] = _turn_disagreements(result["turns"])
    return result


def _multiturn_turn(
    config: SsdServeConfig,
    servers: Mapping[str, SglangServer],
    clusters: Mapping[str, LocalCluster],
    histories: dict[str, list[list[int]]],
    turn: int,
) -> dict[str, Any]:
    n_new = config.first_prompt_tokens if turn == 0 else config.new_tokens_per_turn
    fresh = [M.new_text(config.seed, c, turn, n_new) for c in range(config.clients)]
    arms = {}
    for arm in S.round_order(MULTITURN_ARMS, turn):
        prompts = [histories[arm][c] + fresh[c] for c in range(config.clients)]
        wall_s, requests = M.run_arm_turn(
            servers[arm], prompts, config.answer_tokens, config.parallel
        )
        for c, request in enumerate(requests):
            histories[arm][c] = prompts[c] + request["output_ids"]
        arms[arm] = {"wall_s": wall_s, "requests": requests}
        if arm in clusters:
            arms[arm]["stored_keys"] = M._settle_backup(clusters[arm])
    hits = " ".join(
        f"{arm}={sum(r['tiers']['storage'] for r in arms[arm]['requests'])}"
        for arm in MULTITURN_ARMS
    )
    print(f"ssd multiturn turn {turn}: storage tokens {hits}", file=sys.stderr, flush=True)
    return {"turn": turn, "arms": arms}


def _turn_disagreements(turns: Sequence[Mapping[str, Any]]) -> list[str]:
    bad = []
    for turn in turns:
        answers = {arm: turn["arms"][arm]["requests"] for arm in MULTITURN_ARMS}
        for client in range(len(answers[RECOMPUTE])):
            outputs = {arm: answers[arm][client]["output_ids"] for arm in MULTITURN_ARMS}
            names = S.disagreeing(outputs)
            if names:
                bad.append(f"turn {turn['turn']} client {client}: {', '.join(names)}")
    return bad


# ---- restore after a whole-cluster restart ----------------------------------------------


def _restart_prompts(config: SsdServeConfig) -> list[list[int]]:
    return [
        A.round_prompt(config.seed, "ssd-restart", config.restart_prompt_tokens, i)
        for i in range(config.restart_prompts)
    ]


def _restore_all(server: SglangServer, prompts: Sequence[list[int]], answer_tokens: int) -> list:
    out = []
    for prompt in prompts:
        server.flush_cache()
        answer = server.generate(prompt, answer_tokens)
        out.append({"storage_tokens": answer.storage_tokens, "output_ids": list(answer.output_ids)})
    return out


def run_restart(config: SsdServeConfig) -> dict[str, Any]:
    log_dir = config.work_dir / "logs" / "ssd-restart"
    _fresh(config.ssd_root / "restart")
    prompts = _restart_prompts(config)
    fields_tokens = config.restart_prompt_tokens + 1024
    before: dict[str, list] = {}
    with ExitStack() as stack:
        servers, clusters = start_arms(
            (RECOMPUTE, *RESTART_ARMS), config, stack, log_dir, "restart", fields_tokens
        )
        expected = [
            list(servers[RECOMPUTE].generate(p, config.answer_tokens).output_ids) for p in prompts
        ]
        for arm in RESTART_ARMS:
            keys_before = A.stored_keys(clusters[arm])
            for prompt in prompts:
                servers[arm].generate(prompt, config.answer_tokens)
            M._settle_backup(clusters[arm])
            before[arm] = _restore_all(servers[arm], prompts, config.answer_tokens)
            if arm == SPAN_SSD:
                _wait_on_disk(clusters[arm], A.stored_keys(clusters[arm]) - keys_before)
        time.sleep(MOONCAKE_HEARTBEAT_S + 2)  # mooncake-ssd's own offload heartbeat
    started = time.monotonic()
    with ExitStack() as stack:
        servers, _ = start_arms(RESTART_ARMS, config, stack, log_dir, "restart", fields_tokens)
        up_s = time.monotonic() - started
        after = {
            arm: _restore_all(servers[arm], prompts, config.answer_tokens) for arm in RESTART_ARMS
        }
    arms = {}
    for arm in RESTART_ARMS:
        stored = sum(r["storage_tokens"] for r in before[arm])
        restored = sum(r["storage_tokens"] for r in after[arm])
        arms[arm] = {
            "stored_tokens": stored,
            "restored_tokens": restored,
            "restorable_share": restored / stored if stored else 0.0,
            "wrong_answers": sum(
                r["output_ids"] != e
                for r, e in zip(before[arm] + after[arm], expected * 2, strict=True)
            ),
            "before": before[arm],
            "after": after[arm],
        }
    return {
        "prompts": len(prompts),
        "prompt_tokens": config.restart_prompt_tokens,
        "restart_up_s": up_s,
        "arms": arms,
    }


# ---- the workload -------------------------------------------------------------------------


def run_ssd_workload(
    config: SsdServeConfig, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    started = time.monotonic()
    result: dict[str, Any] = {"workload": "ssd", "config": config.described()}
    for part, run in (
        ("ttft", run_ttft),
        ("restart", run_restart),
        ("multiturn", run_ssd_multiturn),
    ):
        result[part] = run(config)
        result["wall_s"] = time.monotonic() - started
        if checkpoint is not None:
            checkpoint(result)
    return result


def ssd_disagreements(result: Mapping[str, Any]) -> list[str]:
    bad = [f"ssd ttft {w}" for w in result.get("ttft", {}).get("disagreeing", [])]
    bad += [f"ssd multiturn {w}" for w in result.get("multiturn", {}).get("disagreeing", [])]
    for arm, record in result.get("restart", {}).get("arms", {}).items():
        if record["wrong_answers"]:
            bad.append(f"ssd restart {arm}: {record['wrong_answers']} answers differ")
    return bad


def format_ssd(result: Mapping[str, Any]) -> str:
    lines = []
    ttft = result.get("ttft")
    if ttft:
        t = ttft["ttft_s"]
        lines.append(
            f"ssd ttft {ttft['prompt_tokens']} tokens: SSD p50 {t['ssd']['p50']:.2f} s, DRAM p50 "
            f"{t['dram']['p50']:.2f} s, recompute p50 {t[RECOMPUTE]['p50']:.2f} s; paired "
            f"SSD/DRAM p50 {ttft['ssd_over_dram']['p50']:.2f}x "
            f"(max {ttft['ssd_over_dram']['max']:.2f}x)"
        )
    for arm, record in result.get("restart", {}).get("arms", {}).items():
        lines.append(
            f"ssd restart {arm:<13} {record['restored_tokens']}/{record['stored_tokens']} "
            f"tokens restored ({record['restorable_share']:.1%}), {record['wrong_answers']} wrong"
        )
    for arm, summary in result.get("multiturn", {}).get("arms", {}).items():
        later = summary["later_turns"]
        lines.append(
            f"ssd multiturn {arm:<13} turns 2+: L3 {later['hit_rate']['storage']:.1%} "
            f"host {later['hit_rate']['host']:.1%} device {later['hit_rate']['device']:.1%}, "
            f"{later['input_tokens_per_s']:.0f} input tokens/s"
        )
    return "\n".join(lines)
