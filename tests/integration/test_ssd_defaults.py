"""The SSD tier with default settings: a real master, a real storage node with
``--ssd-dir``, the backend with real sglang host pools (K=4 MLA, 1 MiB keys),
and no ``span_object_checksums`` in the client config (``cluster up`` prints
none any more).

1. rot after a restart misses, 0 wrong bytes: the client sealed without being
   told, because the node published the cluster's SSD-tier marker
   (store/ssd_marker.py); the negative control, a client that turned seals and
   the guard off, is served the same rot as wrong bytes;
2. ``span_object_checksums: false`` on that cluster is refused in one line;
3. the node's check is metadata only by default (a torn file is deleted at
   the next start, a rotted one kept and still never served), and
   ``MOONCAKE_SPAN_SSD_CHECK`` reaches the node ``LocalCluster`` starts
   (``full`` deletes the rotted file), under ``ssd_check`` when both are set.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_span.errors import ConfigError
from mooncake_span.ops.cluster import LocalCluster
from mooncake_span.store.ssd_marker import MARKER_KEY
from tests.conftest import require_mooncake
from tests.integration.ssd_keys import (
    ROTTED,
    Keys,
    missed_and_wrong,
    node_log,
    node_with_ssd,
    rot,
    tear,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

TORN = [2]


@pytest.fixture(autouse=True)
def _needs_mooncake() -> None:
    require_mooncake()


def _cluster(tmp_path: Path, **spec: Any) -> LocalCluster:
    return LocalCluster(node_with_ssd(tmp_path, **spec))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with _cluster(tmp_path) as started:
        yield started


def _on_disk(keys: Keys, row: int) -> bool:
    return bool(keys._bucket_files()[keys.names[row]])


def test_rot_after_a_restart_misses_with_default_settings_and_is_served_without_seals(cluster):
    assert "span_object_checksums" not in cluster.client_config()
    default = Keys(cluster, "default", seed=47)
    unsealed = Keys(cluster, "unsealed", span_object_checksums=False, span_layout_guard="off")
    try:
        assert default.store.client.options.object_checksums is True
        default.write_all()
        unsealed.write_all()
        cluster.restart_storage_node(0)  # graceful: every object comes back from disk only
        for keys in (default, unsealed):
            for row in ROTTED:
                rot(keys.bucket(row))
            keys.fresh()
        assert missed_and_wrong(default) == (ROTTED, [])
        assert default.store.client.stats()["integrity_failures"] == {"SEAL_MISMATCH": 3}
        # Negative control: without seals the same rot is a hit with wrong bytes.
        assert missed_and_wrong(unsealed) == ([], ROTTED)
    finally:
        default.store.close()
        unsealed.store.close()


def test_a_client_that_would_not_seal_is_refused_in_one_line(cluster):
    with pytest.raises(ConfigError, match="span_object_checksums is false but") as refused:
        Keys(cluster, "refused", span_object_checksums=False)
    assert "\n" not in str(refused.value) and MARKER_KEY in str(refused.value)


def test_the_default_check_reads_metadata_only_and_rot_is_still_never_served(cluster):
    keys = Keys(cluster, "meta")
    try:
        keys.write_all()
        keys.store.close()
        cluster.restart_storage_node(0)
        for row in ROTTED:
            rot(keys.bucket(row))
        for row in TORN:
            tear(keys.bucket(row))
        cluster.restart_storage_node(0)  # the size check: the torn file goes, rot stays
        log = node_log(cluster)
        assert "SSD check size (from the default)" in log
        assert "deleted 1 torn and 0 corrupt" in log
        assert all(_on_disk(keys, r) for r in ROTTED)
        assert not _on_disk(keys, TORN[0])
        keys.store = keys.backend()
        assert missed_and_wrong(keys) == (sorted(ROTTED + TORN), [])
    finally:
        keys.store.close()


def test_the_environment_reaches_the_node_and_the_flag_wins_over_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONCAKE_SPAN_SSD_CHECK", "full")
    with _cluster(tmp_path) as cluster:
        keys = Keys(cluster, "envcheck")
        try:
            keys.write_all()
            keys.store.close()
            cluster.restart_storage_node(0)
            for row in ROTTED:
                rot(keys.bucket(row))
            cluster.restart_storage_node(0)
            log = node_log(cluster)
            assert "SSD check full (from MOONCAKE_SPAN_SSD_CHECK)" in log
            assert "deleted 0 torn and 3 corrupt" in log
            assert not any(_on_disk(keys, r) for r in ROTTED)
        finally:
            keys.store.close()
    with _cluster(tmp_path, ssd_check="off") as cluster:
        assert "SSD check off (from --ssd-check)" in node_log(cluster)
