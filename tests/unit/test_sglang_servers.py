"""Command lines, environments and answers of the real-server support, without servers."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from mooncake_span.ops import launcher as L
from mooncake_span.ops.master_http import parse_prometheus
from mooncake_span_tools.lab.serve_demo import (
    HIT_KEYS,
    HIT_QUERIES,
    UNFULFILLED,
    PoolReads,
    RestoreEvidence,
    ServeDemoConfig,
    ServeDemoReport,
    explain_restore,
)
from mooncake_span_tools.lab.sglang_servers import (
    DYNAMIC_BACKEND_KEYS,
    PLUGIN_OPT_IN_ENV,
    Completion,
    ServerError,
    ServerOptions,
    SglangServer,
    _Served,
    parse_completion,
    router_argv,
    server_argv,
    server_env,
    sum_samples,
)
from mooncake_span_tools.testing.cpu_server import SITE_DIR
from mooncake_span_tools.testing.cpu_server.models import TinyModelSpec, prompt_text

MODEL = Path("/models/tiny")


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"storage_backend": "file"}, "storage_backend"),
        ({"prefetch_policy": "eager"}, "prefetch_policy"),
        ({"plugin_opt_in": True}, "plugin_opt_in"),
        ({"disaggregation_mode": "both"}, "disaggregation_mode"),
        ({"disaggregation_mode": "prefill"}, "bootstrap_port"),
        ({"bootstrap_port": 9000}, "bootstrap_port"),
        ({"decode_offload": True}, "decode_offload"),
        ({"disaggregation_mode": "decode", "decode_offload": True, "storage_backend": None}, "L3"),
    ],
)
def test_bad_server_options_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        ServerOptions(model_path=MODEL, **fields)


def test_dynamic_backend_argv_loads_this_backend():
    options = ServerOptions(
        model_path=MODEL, storage_config={"master_server_address": "127.0.0.1:1"}
    )
    argv = server_argv(options, port=1234, python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    assert _flag(argv, "--port") == "1234"
    assert _flag(argv, "--hicache-storage-backend") == "dynamic"
    assert _flag(argv, "--hicache-mem-layout") == "page_first_direct"
    assert _flag(argv, "--hicache-storage-prefetch-policy") == "timeout"
    extra = json.loads(_flag(argv, "--hicache-storage-backend-extra-config"))
    assert extra == {**DYNAMIC_BACKEND_KEYS, "master_server_address": "127.0.0.1:1"}
    assert "--enable-hierarchical-cache" in argv


def test_recompute_server_has_no_storage_flags():
    argv = server_argv(ServerOptions(model_path=MODEL, storage_backend=None), port=1)
    assert not [a for a in argv if a.startswith("--hicache-storage")]


def test_mooncake_name_keeps_the_config_as_given():
    options = ServerOptions(
        model_path=MODEL, storage_backend="mooncake", storage_config={"protocol": "tcp"}
    )
    extra = json.loads(_flag(server_argv(options, 1), "--hicache-storage-backend-extra-config"))
    assert extra == {"protocol": "tcp"}


def test_prefill_and_decode_argv():
    prefill = server_argv(
        ServerOptions(model_path=MODEL, disaggregation_mode="prefill", bootstrap_port=8998), 1
    )
    assert _flag(prefill, "--disaggregation-mode") == "prefill"
    assert _flag(prefill, "--disaggregation-bootstrap-port") == "8998"
    assert _flag(prefill, "--disaggregation-transfer-backend") == "mooncake"
    decode = server_argv(
        ServerOptions(model_path=MODEL, disaggregation_mode="decode", decode_offload=True), 1
    )
    # sglang refuses a hierarchical cache on a decode server (its radix cache is off).
    assert "--enable-hierarchical-cache" not in decode
    assert "--disaggregation-decode-enable-offload-kvcache" in decode
    assert _flag(decode, "--hicache-storage-backend") == "dynamic"


def test_server_env_puts_the_stand_ins_first():
    env = server_env({"X": "1"}, base={"PYTHONPATH": "/a:/b", "OMP_NUM_THREADS": "4"})
    assert env["PYTHONPATH"].split(":") == [str(SITE_DIR), "/a", "/b"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    assert env["OMP_NUM_THREADS"] == "4"
    assert env["X"] == "1"
    assert (SITE_DIR / "sitecustomize.py").is_file()


def test_plugin_opt_in_reaches_the_server_env(tmp_path):
    options = ServerOptions(model_path=MODEL, storage_backend="mooncake", plugin_opt_in=True)
    server = SglangServer("s", options, tmp_path, port=1)
    assert server.process.env[PLUGIN_OPT_IN_ENV] == "1"
    plain = SglangServer("t", ServerOptions(model_path=MODEL), tmp_path, port=2)
    assert plain.process.env[PLUGIN_OPT_IN_ENV] == "0"


def test_parse_completion_reads_storage_tokens():
    answer = {
        "output_ids": [5, 6],
        "meta_info": {
            "prompt_tokens": 640,
            "cached_tokens": 576,
            "cached_tokens_details": {"device": 0, "host": 0, "storage": 576},
        },
    }
    completion = parse_completion(answer, 0.5)
    assert (completion.output_ids, completion.prompt_tokens) == ((5, 6), 640)
    assert (completion.cached_tokens, completion.storage_tokens) == (576, 576)
    bare = parse_completion({"output_ids": [1], "meta_info": {"cached_tokens_details": None}}, 0)
    assert bare.storage_tokens == 0


def test_router_argv_names_every_worker():
    argv = router_argv([("http://p:1", 8998)], ["http://d:2"], port=3, prometheus_port=4)
    assert argv[argv.index("--prefill") + 1 : argv.index("--prefill") + 3] == ["http://p:1", "8998"]
    assert _flag(argv, "--decode") == "http://d:2"
    assert _flag(argv, "--prometheus-port") == "4"
    assert "--pd-disaggregation" in argv


def test_tiny_models_and_prompt_text():
    with pytest.raises(ValueError, match="architecture"):
        TinyModelSpec(architecture="gpt2")
    with pytest.raises(ValueError, match="num_heads"):
        TinyModelSpec(hidden_size=60, num_heads=8)
    assert TinyModelSpec().digest() == TinyModelSpec().digest() != TinyModelSpec(seed=1).digest()
    assert prompt_text([3, 0, 12]) == "w3 w0 w12"
    assert TinyModelSpec(architecture="deepseek_v2").is_mla


def _evidence(storage, delta=None, backed_up=9, expected=9):
    return RestoreEvidence(
        page_tokens=64,
        restorable_tokens=576,
        storage_tokens=storage,
        backed_up_keys=backed_up,
        expected_keys=expected,
        metrics_delta=delta or {},
    )


def test_serve_demo_config_and_verdict():
    with pytest.raises(ValueError, match="prompt_tokens"):
        ServeDemoConfig(prompt_tokens=128)
    with pytest.raises(ValueError, match="architecture"):
        ServeDemoConfig(architecture="mamba")

    with pytest.raises(ValueError, match="at least 1280"):
        ServeDemoConfig(architecture="glm5_next", prompt_tokens=1024)
    glm = ServeDemoConfig(architecture="glm5_next")
    assert (glm.page_tokens, glm.pools) == (256, ("kv", "indexer", "mamba"))

    def done(ids, storage, shift=0.0):
        top = tuple(((t, -1.0 + shift), (t + 1, -2.0)) for t in ids)
        return Completion(ids, 640, storage, storage, 0.1, {}, top)

    read = {"kv": PoolReads(9, 100), "indexer": PoolReads(9, 50), "mamba": PoolReads(1, 9)}

    def report(first, second, reads=read):
        return ServeDemoReport(first, second, 1.0, _evidence(second.storage_tokens), reads)

    assert report(done((1, 2), 0), done((1, 2), 576)).ok
    assert not report(done((1, 2), 0), done((1, 3), 576)).ok
    assert not report(done((1, 2), 0), done((1, 2), 0)).ok
    # Restoring some pages is not enough: every restorable page must come back.
    assert not report(done((1, 2), 0), done((1, 2), 512)).ok
    # the same tokens from a context whose logprobs moved: the oracle says no
    assert not report(done((1, 2), 0), done((1, 2), 576, 0.01)).ok
    # one pool never read
    assert not report(done((1, 2), 0), done((1, 2), 576), {**read, "mamba": PoolReads(0, 0)}).ok


def test_serve_demo_says_why_a_restore_fell_short():
    assert explain_restore(_evidence(576)) == []
    queried = {HIT_QUERIES: 1.0, HIT_KEYS: 9.0}
    (dropped,) = explain_restore(
        _evidence(0, {**queried, f'{UNFULFILLED}{{reason="deadline"}}': 576})
    )
    assert "dropped 576 prefetched tokens (reason deadline)" in dropped
    assert "wait_complete" in dropped
    (never,) = explain_restore(_evidence(0, {}))
    assert "never asked L3" in never
    (found,) = explain_restore(_evidence(320, {HIT_QUERIES: 1.0, HIT_KEYS: 5.0}))
    assert "found 5 of 9 pages" in found
    stored, asked = explain_restore(_evidence(0, {HIT_QUERIES: 1.0}, backed_up=0))
    assert "0 of 9 pages in L3" in stored and "found 0 of 9 pages" in asked
    (unknown,) = explain_restore(_evidence(512, queried))
    assert "no counter explains it" in unknown


def test_server_metrics_are_summed_per_family_and_label():
    samples = parse_prometheus(
        'x_total{model="m",reason="deadline"} 3\nx_total{model="m",reason="dropped"} 2\ny 1\n'
    )
    sums = sum_samples(samples)
    assert sums["x_total"] == 5 and sums["y"] == 1
    assert sums['x_total{reason="deadline"}'] == 3 and sums['x_total{model="m"}'] == 5


def test_picked_ports_lie_below_the_ephemeral_range():
    # A port from inside the ephemeral range can be taken by any outgoing
    # connection's source port before the server binds it.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = L.pick_free_ports("127.0.0.1", 20)
    assert len(set(ports)) == 20
    assert all(1024 <= port < low for port in ports), (low, ports)


# Serves what _Served polls for (/model_info, /health) on the port it is given,
# or prints the bind error and exits when that port is taken.
_FAKE_SERVER = """
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"model_path": "fake"}'
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_server_whose_picked_port_was_taken_restarts_on_a_fresh_one(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]

        def argv(port: int) -> list[str]:
            return [sys.executable, "-c", _FAKE_SERVER, str(port)]

        fresh = L.pick_free_ports("127.0.0.1", 1)[0]
        served = _Served(
            "fake", argv(taken), {}, tmp_path, taken, repick=lambda: (fresh, argv(fresh))
        )
        served.process.start()
        try:
            served.wait_ready(timeout_s=30.0)
            assert served.port == fresh
            assert served.url.endswith(f":{fresh}")
        finally:
            served.stop(grace_s=5.0)


def test_a_given_port_that_is_taken_is_not_repicked(tmp_path):
    # A port the caller chose (a fixed port inside a namespace) is not ours to change:
    # the process's own exit is the error.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        served = _Served(
            "fake", [sys.executable, "-c", _FAKE_SERVER, str(taken)], {}, tmp_path, taken
        )
        served.process.start()
        with pytest.raises(ServerError, match="exited with 1 before it served"):
            served.wait_ready(timeout_s=30.0)
