"""The topology itself: addresses bound per host, and partition/heal of one host."""

from __future__ import annotations

import time

import pytest

from mooncake_span_tools.lab.netns import MASTER_RPC_PORT

pytestmark = [pytest.mark.netns, pytest.mark.integration]


def test_hosts_reach_each_other_only_over_the_bridge(pd_topology, pd_cluster, figures):
    topo = pd_topology
    master = topo.address("master")
    assert topo.can_connect("decode", master, MASTER_RPC_PORT)
    # The master is bound to its own address, not to every interface.
    assert not topo.can_connect("master", "127.0.0.1", MASTER_RPC_PORT, timeout_s=0.5)

    topo.partition("decode")
    started = time.monotonic()
    try:
        cut = topo.can_connect("decode", master, MASTER_RPC_PORT, timeout_s=0.5)
        # other hosts are unaffected
        others = topo.can_connect("prefill", master, MASTER_RPC_PORT)
    finally:
        topo.heal("decode")
    healed = topo.can_connect("decode", master, MASTER_RPC_PORT, timeout_s=2.0)
    figures.record(
        partitioned_connect=cut,
        other_host_connect=others,
        healed_connect=healed,
        partition_heal_s=round(time.monotonic() - started, 3),
    )
    assert (cut, others, healed) == (False, True, True)
