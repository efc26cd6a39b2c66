"""Real servers on separate hosts (network namespaces), the bytes on a dedicated storage node.

Hosts ``master`` (master with its HTTP metadata server), ``store1`` (the only
segment), ``writer`` and ``reader`` (a server each, pure clients with no
segment of their own). The writer answers a prompt and is SIGKILLed; the
reader, on another host, restores the prompt from the storage node and
answers exactly as a server that recomputes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake_span_tools.lab.netns_cluster import NetnsCluster, NetnsClusterSpec
from mooncake_span_tools.lab.sglang_servers import ServerOptions, namespace_place
from mooncake_span_tools.lab.topology import NetnsTopology, TopologySpec
from tests.conftest import require_netns
from tests.servers.conftest import (
    ANSWER_TOKENS,
    PAGE_TOKENS,
    PROMPT_TOKENS,
    prompt,
    settled_key_count,
    wait_until,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.servers,
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

HOSTS = ("master", "store1", "writer", "reader")
SERVER_PORT = 30000


@pytest.fixture
def hosts(tmp_path) -> Iterator[tuple[NetnsTopology, NetnsCluster]]:
    require_netns()
    topology = NetnsTopology(TopologySpec(hosts=HOSTS), log_dir=tmp_path / "netns")
    with topology:
        spec = NetnsClusterSpec(master_hosts=("master",), storage_hosts=("store1",))
        with NetnsCluster(topology, spec, name="servers") as cluster:
            yield topology, cluster


def test_reader_on_another_host_restores_from_the_storage_node(
    hosts, tiny_model, launched, recompute_server
):
    topology, cluster = hosts
    servers = {}
    for host in ("writer", "reader"):
        options = ServerOptions(
            model_path=tiny_model("llama"), storage_config=cluster.client_config(host)
        )
        place = namespace_place(topology, host)
        servers[host] = launched.server(host, options, port=SERVER_PORT, place=place)
    recompute_server.prestart("llama")
    launched.start(*servers.values())
    recompute = recompute_server("llama")
    p = prompt(7)
    expected = recompute(p)
    keys_url = f"{cluster.metrics_url(0)}/get_all_keys"

    def stored() -> int:
        answer = topology.http_get("master", keys_url, timeout_s=5.0)
        return 0 if answer is None else len(answer[1].split())

    base = settled_key_count(stored)
    written = servers["writer"].generate(p, ANSWER_TOKENS)
    assert written.output_ids == expected.output_ids
    pages = PROMPT_TOKENS // PAGE_TOKENS
    wait_until(lambda: stored() >= base + pages - 1, 30.0, "the writer's backup")
    servers["writer"].kill()

    restored = servers["reader"].generate(p, ANSWER_TOKENS)
    assert restored.storage_tokens == PROMPT_TOKENS - PAGE_TOKENS, restored.meta_info
    assert restored.output_ids == expected.output_ids
