"""``mooncake-span validate`` against real sglang servers that it did not start.

One module of servers shared by most cases: a cluster with one storage node,
two servers of this backend (the second is ``FaultyRestoreStore``: the
backend plus the test hook that can spoil one restore on purpose; without a
fault it is the backend's own read path), one of sglang's ``MooncakeStore``,
and the session's server without an L3. Two of them also stand for servers
validate once refused, at no extra start: the faulty one runs with
``--skip-tokenizer-init`` (no tokenizer: answers are ids without text, and
probes come from the ids its model proposes), and ``MooncakeStore`` serves
the tiny Llama with a byte-level tokenizer (256 byte tokens, no word of two
letters). The tokenizer is beside the point of either backend's restore.
The servers use the ``wait_complete`` prefetch policy: on this shared 2-core
box sglang's default ``timeout`` policy sometimes drops a prefetch under
load, which validate reports as a failure ("prefetch dropped") and these
tests are not about.

Covered: this backend passes with two servers (the second without a
tokenizer), with one server and a flush, with one server without a
tokenizer, and with one server and churn eviction (and churn too small to
evict is no pass); ``MooncakeStore`` with a byte-level tokenizer passes; a
server without L3 fails with no storage hits; each restore fault fails at
the one probe it spoils and only there (on the server without a tokenizer);
``--save`` / ``--against`` across a whole-cluster restart with the SSD tier;
GLM-5.3-Flash (``glm5_next``) restores all three pools.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mooncake_span.ops import cli
from mooncake_span.ops import validate as V
from mooncake_span.ops.validate_http import ServerRefused, SglangHttp
from mooncake_span_tools.lab.sglang_servers import START_TIMEOUT_S, ServerOptions
from mooncake_span_tools.testing import restore_faults
from mooncake_span_tools.testing.cpu_server.models import default_spec, serving_profile
from tests.servers.conftest import Launched, stored_keys, wait_until
from tests.span_helpers import master_replicas

pytestmark = [pytest.mark.integration, pytest.mark.servers, pytest.mark.slow]

POLICY = "wait_complete"
METRICS = ("--enable-metrics",)
FEW_DEPTHS = "25,75"
OFFLOAD_TIMEOUT_S = 30.0


def validate(capsys, *args: str) -> tuple[int, dict]:
    """Run the command in this process; (exit code, its JSON document)."""
    capsys.readouterr()
    code = cli.main(["validate", "--json", *args])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    print(captured.err[-3000:])
    print(doc.get("summary"), doc.get("reasons"))
    return code, doc


def restored_everything(doc: dict) -> bool:
    return all(r["storage_tokens"] == r["restorable_tokens"] > 0 for r in doc["results"])


NO_TOKENIZER = ("--skip-tokenizer-init",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The byte-level tokenizer's special tokens follow its 256 byte tokens.
_BYTE_SPECIALS = ("<pad>", "<s>", "</s>")


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's scheme): printable
    Latin-1 bytes stand for themselves, the rest for code points from 256 on."""
    kept = {*range(33, 127), *range(161, 173), *range(174, 256)}
    spare = iter(range(256, 512))
    return {b: chr(b) if b in kept else chr(next(spare)) for b in range(256)}


def byte_level_model(model: Path, target: Path) -> Path:
    """``model`` (the tiny Llama) with a byte-level tokenizer: ids 0-255 are the bytes,
    then the special tokens, which config.json names (the weights are unchanged; the
    model's 512 embedding rows cover the 259 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model, target, ignore=shutil.ignore_patterns(*_TOKENIZER_FILES))
    vocab = {char: b for b, char in _byte_chars().items()}
    vocab.update({token: 256 + i for i, token in enumerate(_BYTE_SPECIALS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    pad, bos, eos = _BYTE_SPECIALS
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=pad, bos_token=bos, eos_token=eos
    ).save_pretrained(target)
    for name in ("config.json", "generation_config.json"):
        path = target / name
        if path.exists():
            config = json.loads(path.read_text())
            ids = {"pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258}
            config.update({k: v for k, v in ids.items() if k in config or name == "config.json"})
            path.write_text(json.dumps(config, indent=1))
    return target


class Deployment:
    def __init__(self, cluster, ours, faulty, mooncake_store, no_l3, fault_file):
        self.cluster, self.ours, self.faulty = cluster, ours, faulty
        self.mooncake_store, self.no_l3, self.fault_file = mooncake_store, no_l3, fault_file


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, tiny_model, recompute_server):
    root = tmp_path_factory.mktemp("validate")
    launched = Launched(root / "logs")
    fault_file = root / "restore-fault.json"
    restore_faults.write_fault(fault_file, None)
    try:
        cluster = launched.cluster(storage_nodes=1)
        config = cluster.client_config(0)
        base = ServerOptions(
            model_path=tiny_model("llama"),
            storage_config=config,
            prefetch_policy=POLICY,
            extra_args=METRICS,
            env=cluster.client_env(),
        )
        ours = launched.server("ours", base)
        faulty = launched.server(
            "faulty",
            dataclasses.replace(
                base,
                storage_config={
                    **config,
                    "module_path": restore_faults.MODULE_PATH,
                    "class_name": restore_faults.CLASS_NAME,
                },
                env={**cluster.client_env(), restore_faults.FAULT_FILE_ENV: str(fault_file)},
                extra_args=(*METRICS, *NO_TOKENIZER),
            ),
        )
        mooncake_store = launched.server(
            "mooncake-store",
            dataclasses.replace(
                base,
                model_path=byte_level_model(tiny_model("llama"), root / "llama-bytes"),
                storage_backend="mooncake",
                # sglang's own MooncakeStore reads the Mooncake keys; ours are span_*.
                storage_config={k: v for k, v in config.items() if not k.startswith("span_")},
            ),
        )
        with ThreadPoolExecutor(1) as pool:
            reference = pool.submit(recompute_server, "llama")
            launched.start(ours, faulty, mooncake_store)
            no_l3 = reference.result(timeout=START_TIMEOUT_S).server
        yield Deployment(cluster, ours, faulty, mooncake_store, no_l3, fault_file)
    finally:
        launched.stop_all()


@pytest.mark.timeout(600)
def test_two_servers_of_this_backend_pass(deployment, capsys):
    """The default probe set: cold pass on one server, L3 pass on the other."""
    started = time.monotonic()
    # The wait for the cold pass's backups ends when they land; under the suite's load
    # a CPU server once took over the default 60 s for 10 probes (3 still pending).
    servers = ("--server", deployment.ours.url, "--server", deployment.faulty.url)
    code, doc = validate(capsys, *servers, "--backup-wait-s", "180")
    print(f"default probe set, two servers: {time.monotonic() - started:.1f} s")
    assert code == 0, doc["reasons"]
    assert doc["ok"] and doc["probes"] == 10 and doc["agreeing"] == 10
    assert [r["depth"] for r in doc["results"]] == [
        0.1,
        0.2,
        0.3,
        0.4,
        0.5,
        0.6,
        0.7,
        0.8,
        0.9,
        0.95,
    ]
    assert restored_everything(doc)
    assert doc["restored_tokens"] == doc["restorable_tokens"]
    assert {r["storage_backend"] for r in doc["results"]} == {"FaultyRestoreStore"}
    assert (
        doc["l3_counter_deltas"]["sglang:storage_prefetch_hit_tokens_total"]
        >= (doc["restorable_tokens"])
    )
    assert doc["eviction"].startswith("none")
    assert "grew by" in doc["backup_wait"]
    # Probes from the first server's vocabulary and tokenizer, answered as ids alone.
    assert "plain words" in doc["token_pool"] and "tokenizer" in doc["framed_with"]


@pytest.mark.timeout(600)
def test_one_server_without_a_tokenizer_passes(deployment, capsys):
    """``--skip-tokenizer-init``: no /tokenize or /detokenize, answers without text.
    The probes are ids the model proposed, with no question around them."""
    http = SglangHttp(deployment.faulty.url)
    with pytest.raises(ServerRefused):
        http.token_texts(range(8))
    code, doc = validate(capsys, "--server", deployment.faulty.url, "--depths", FEW_DEPTHS)
    assert code == 0, doc["reasons"]
    assert "the model proposed (no tokenizer)" in doc["token_pool"]
    assert doc["framed_with"].startswith("token ids only")
    assert restored_everything(doc) and doc["agreeing"] == 2


@pytest.mark.timeout(600)
def test_one_server_with_a_flush_passes(deployment, capsys):
    code, doc = validate(capsys, "--server", deployment.ours.url, "--depths", FEW_DEPTHS)
    assert code == 0, doc["reasons"]
    assert restored_everything(doc) and doc["agreeing"] == 2
    assert "/flush_cache" in doc["eviction"]


@pytest.mark.timeout(300)
def test_churn_evicts_from_device_and_host_then_passes(deployment, capsys):
    """``--evict churn`` on one server: unique traffic sized from the pools it reports
    pushes the probes out of device and host memory, so the L3 pass takes every
    restorable token from storage, and agrees."""
    started = time.monotonic()
    code, doc = validate(
        capsys, "--server", deployment.ours.url, "--evict", "churn", "--depths", FEW_DEPTHS
    )
    print(f"churn case: {time.monotonic() - started:.1f} s, churn {doc.get('churn')}")
    assert code == 0, doc["reasons"]
    # The pools as the server reports them, read here apart from the command.
    http = SglangHttp(deployment.ours.url)
    device = http.server_info()["max_total_num_tokens"]
    host = int(http.metrics()["sglang:hicache_host_total_tokens"])
    assert host > device > 0
    churn = doc["churn"]
    assert churn["pool_tokens"] == device + host
    assert churn["tokens"] >= V.CHURN_FACTOR * (device + host)
    assert f"device pool {device} + host pool {host} tokens" in doc["eviction"]
    assert doc["agreeing"] == 2 and restored_everything(doc)
    for result in doc["results"]:
        assert result["device_tokens"] == result["host_tokens"] == 0, result
        assert result["memory_tokens"] == 0, result
    hits = doc["l3_counter_deltas"]["sglang:storage_prefetch_hit_tokens_total"]
    assert hits >= doc["restorable_tokens"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device_pools", [0, 1], ids=["one-prompt", "device-pool-only"])
def test_churn_too_small_to_evict_is_no_pass(deployment, capsys, device_pools):
    """Negative control: churn below the pools leaves the probe in memory, and validate
    says it was not served from storage. ``device-pool-only`` is churn sized as if there
    were no host pool: sglang keeps the probe in host memory, which is not full."""
    device = SglangHttp(deployment.ours.url).server_info()["max_total_num_tokens"]
    started = time.monotonic()
    code, doc = validate(
        capsys,
        "--server",
        deployment.ours.url,
        "--evict",
        "churn",
        "--churn-tokens",
        str(max(device * device_pools, 1)),
        "--depths",
        "50",
    )
    print(f"small churn case ({device_pools} device pools): {time.monotonic() - started:.1f} s")
    assert code == 1 and not doc["ok"]
    assert doc["churn"]["tokens"] <= max(device * device_pools, doc["churn"]["prompt_tokens"])
    assert "too little" in doc["eviction"]
    assert doc["reasons"][0].startswith("not evicted: 1 of 1 probes"), doc["reasons"]
    (result,) = doc["results"]
    assert result["device_tokens"] + result["host_tokens"] > 0, result
    assert result["storage_tokens"] < result["restorable_tokens"], result
    assert doc["failing_depths"] == [0.5]


@pytest.mark.timeout(600)
def test_mooncake_store_with_a_byte_level_tokenizer_passes(deployment, capsys):
    """sglang's own backend; its server's tokenizer has no plain word, so the probes
    are its printable byte tokens."""
    code, doc = validate(capsys, "--server", deployment.mooncake_store.url, "--depths", FEW_DEPTHS)
    assert code == 0, doc["reasons"]
    assert restored_everything(doc)
    assert {r["storage_backend"] for r in doc["results"]} == {"MooncakeStore"}
    assert doc["token_pool"].startswith("94 printable tokens"), doc["token_pool"]


@pytest.mark.timeout(600)
def test_a_server_without_l3_fails(deployment, capsys):
    code, doc = validate(capsys, "--server", deployment.no_l3.url, "--depths", FEW_DEPTHS)
    assert code == 1
    assert doc["reasons"][0].startswith("no storage hits")
    assert doc["agreeing"] == 2 and doc["restored_tokens"] == 0


def spoiled_run(capsys, fault_file, fault, servers, *args):
    """Validate with ``fault`` on the L3 pass's second probe: (exit code, document)."""
    applied_before = len(restore_faults.applied(fault_file))
    restore_faults.write_fault(fault_file, {**fault, "call": 1})
    try:
        code, doc = validate(capsys, *(a for s in servers for a in ("--server", s.url)), *args)
    finally:
        restore_faults.write_fault(fault_file, None)
    assert len(restore_faults.applied(fault_file)) == applied_before + 1, "the fault never fired"
    return code, doc


def assert_fails_at(code, doc, depth, fault):
    """Validate failed at ``depth`` and only there, for the fault's reason."""
    assert code == 1
    assert doc["failing_depths"] == [depth], doc["reasons"]
    label = f"{depth * 100:g}%"
    assert doc["summary"].endswith(f"failing depths: {label}")
    spoiled = next(r for r in doc["results"] if r["depth"] == depth)
    if fault["kind"] == "miss":
        assert spoiled["storage_tokens"] < spoiled["restorable_tokens"], spoiled
    else:
        assert spoiled["storage_tokens"] == spoiled["restorable_tokens"], spoiled
        assert f"disagreement at depth {label}" in doc["reasons"][-1]


# A swap of two pages inside a restored prefix is invisible to an MHA model: its
# attention over cached keys and values does not depend on their order, so no
# answer can show it (measured: the same tokens and logprobs). GLM-5.3-Flash's
# indexer selects positions by content, so there a swap shows (the GLM cases below).
LLAMA_CONTROLS = [
    pytest.param({"kind": "zero", "pool": "kv"}, id="zero"),
    pytest.param({"kind": "miss", "pool": "kv"}, id="miss"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", LLAMA_CONTROLS)
def test_a_spoiled_restore_fails_at_its_probe(deployment, capsys, fault):
    """The L3 pass's second probe (depth 50%) is restored wrong, or reported missing:
    validate fails there, and only there."""
    servers = (deployment.ours, deployment.faulty)
    code, doc = spoiled_run(capsys, deployment.fault_file, fault, servers, "--depths", "20,50,80")
    assert_fails_at(code, doc, 0.5, fault)
    if fault["kind"] == "miss":
        assert "no storage hits at depth 50%" in doc["reasons"]


def _on_disk(cluster) -> tuple[int, int]:
    keys = stored_keys(cluster)
    found = master_replicas(cluster, keys)
    disk = sum(1 for reps in found.values() if any(r.is_local_disk_replica() for r in reps))
    return disk, len(keys)


@pytest.mark.timeout(900)
def test_save_and_against_across_a_whole_cluster_restart(tiny_model, launched, capsys, tmp_path):
    """``--save`` on a cluster with the SSD tier; everything stops but the SSD
    directory; ``--against`` on a new cluster and a new server restores and agrees."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    spec = {"storage_nodes": 1, "storage_node_segment_bytes": 64 << 20, "ssd_dir": ssd}
    cluster = launched.cluster(**spec)
    options = ServerOptions(
        model_path=tiny_model("llama"),
        storage_config=cluster.client_config(0),
        prefetch_policy=POLICY,
        extra_args=METRICS,
        env=cluster.client_env(),
    )
    server = launched.server("before", options)
    launched.start(server)
    saved = tmp_path / "validate.json"
    code, before = validate(
        capsys, "--server", server.url, "--depths", FEW_DEPTHS, "--save", str(saved)
    )
    assert code == 0, before["reasons"]
    # Offload is one heartbeat behind the put: stop only once every object is on disk.
    wait_until(lambda: len(set(_on_disk(cluster))) == 1, OFFLOAD_TIMEOUT_S, "every object on SSD")

    server.stop()
    cluster.stop()
    again = launched.cluster(**spec)
    fresh = launched.server(
        "after",
        dataclasses.replace(options, storage_config=again.client_config(0), env=again.client_env()),
    )
    launched.start_cold(fresh)  # validate warms it up itself
    code, after = validate(capsys, "--server", fresh.url, "--against", str(saved))
    assert code == 0, after["reasons"]
    assert [r["storage_tokens"] for r in after["results"]] == [
        r["storage_tokens"] for r in before["results"]
    ]
    assert after["agreeing"] == 2


GLM_POOLS = ("kv", "indexer", "mamba")
GLM_ARGS = ("--context-tokens", "2048", "--depths", FEW_DEPTHS)


@pytest.fixture(scope="module")
def glm(tmp_path_factory, tiny_model):
    """A GLM-5.3-Flash writer and a reader with the restore-fault hook, one cluster."""
    root = tmp_path_factory.mktemp("validate-glm")
    launched = Launched(root / "logs")
    fault_file = root / "restore-fault.json"
    restore_faults.write_fault(fault_file, None)
    try:
        cluster = launched.cluster(storage_nodes=1)
        profile = serving_profile(default_spec("glm5_next"))
        config = cluster.client_config(0)
        options = ServerOptions(
            model_path=tiny_model("glm5_next"),
            storage_config=config,
            prefetch_policy=POLICY,
            **profile.server_fields(METRICS, cluster.client_env()),
        )
        writer = launched.server("writer", options)
        reader = launched.server(
            "reader",
            dataclasses.replace(
                options,
                storage_config={
                    **config,
                    "module_path": restore_faults.MODULE_PATH,
                    "class_name": restore_faults.CLASS_NAME,
                },
                env={**options.env, restore_faults.FAULT_FILE_ENV: str(fault_file)},
            ),
        )
        launched.start(writer, reader)
        yield writer, reader, fault_file
    finally:
        launched.stop_all()


@pytest.mark.timeout(900)
def test_glm5_next_restores_all_three_pools(glm, capsys):
    writer, reader, _fault_file = glm
    code, doc = validate(capsys, "--server", writer.url, "--server", reader.url, *GLM_ARGS)
    assert code == 0, doc["reasons"]
    assert restored_everything(doc) and doc["agreeing"] == 2
    reads = doc["l3_counter_deltas"]
    for pool in GLM_POOLS:
        read = f'mooncake_span_keys_total{{operation="get",pool="{pool}",result="ok"}}'
        assert reads.get(read, 0) > 0, (pool, reads)


GLM_CONTROLS = [
    pytest.param({"kind": "swap", "pool": "kv", "first": 1, "second": 5}, id="kv-swap"),
    pytest.param({"kind": "swap", "pool": "indexer", "first": 1, "second": 5}, id="indexer-swap"),
    pytest.param({"kind": "zero", "pool": "mamba"}, id="state-zero"),
    pytest.param({"kind": "miss", "pool": "mamba"}, id="state-miss"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", GLM_CONTROLS)
def test_glm5_next_spoiled_restore_fails_at_its_probe(glm, capsys, fault):
    writer, reader, fault_file = glm
    code, doc = spoiled_run(capsys, fault_file, fault, (writer, reader), *GLM_ARGS)
    assert_fails_at(code, doc, 0.75, fault)
