"""The same Mooncake config reaches ``MooncakeDistributedStore.setup`` unchanged,
whether sglang 0.5.23's own ``MooncakeStore`` or ``MooncakeSpanStore`` reads it.

Both constructors run for real against the session cluster's master: the
store class is replaced by a subclass whose ``setup`` records its arguments
and then calls the real one. Arguments are compared by name after binding
them to the signature the wheel documents (positional or keyword, defaults
filled), so "passed as a default" and "passed explicitly" compare equal.

Nothing of sglang is patched; only the process environment is set per case
(the environment is one of the sources under test). Every case runs over TCP
(the CPU wheel has no RDMA), so a NIC name reaches setup but picks nothing.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

import pytest

from mooncake_span.mooncake_settings import CONFIG_PATH_ENV
from mooncake_span.store.ssd_tier import HEARTBEAT_ENV, SsdTier

pytestmark = pytest.mark.integration

_ENV_NAMES = (
    CONFIG_PATH_ENV,
    "MOONCAKE_MASTER",
    "MOONCAKE_CLIENT",
    "MOONCAKE_LOCAL_HOSTNAME",
    "LOCAL_HOSTNAME",
    "MOONCAKE_TE_META_DATA_SERVER",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "MOONCAKE_PROTOCOL",
    "MOONCAKE_DEVICE",
    "MOONCAKE_MASTER_METRICS_PORT",
    "MOONCAKE_CHECK_SERVER",
    "MOONCAKE_STANDALONE_STORAGE",
    "MOONCAKE_ENABLE_SSD_OFFLOAD",
    "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
    "MOONCAKE_TENANT_ID",
)
NICS8 = {str(rank): f"mlx5_{rank}" for rank in range(8)}
# json.dumps writes int keys as strings, so an operator's {0: ...} map arrives like this.
NICS8_INT_KEYS = json.dumps({rank: f"mlx5_{rank}" for rank in range(8)})
NICS_MISSING_5 = json.dumps({k: v for k, v in NICS8.items() if k != "5"})


def _signature(store_class: type) -> list[tuple[str, Any]]:
    """(name, default) of the keyword overload, read from the wheel's own docstring."""
    doc = store_class.setup.__doc__
    line = next(ln for ln in doc.splitlines() if "local_hostname: str" in ln)
    params = line[line.index("(") + 1 : line.rindex(")")].split(", ")[1:]  # drop self
    out = []
    for param in params:
        name, _, rest = param.partition(": ")
        _, _, default = rest.partition(" = ")
        out.append((name, eval(default) if default else inspect_required))  # noqa: S307
    return out


inspect_required = object()


def _bind(sig: list[tuple[str, Any]], args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = {name: default for name, default in sig}
    for (name, _), value in zip(sig, args, strict=False):
        bound[name] = value
    bound.update(kwargs)
    assert inspect_required not in bound.values(), bound
    return bound


@pytest.fixture
def recorded_setups(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    import mooncake.store

    calls: list[dict[str, Any]] = []
    real = mooncake.store.MooncakeDistributedStore
    sig = _signature(real)

    class Recording(real):  # type: ignore[misc, valid-type]
        def setup(self, *args: Any, **kwargs: Any) -> int:
            calls.append(_bind(sig, args, kwargs))
            return super().setup(*args, **kwargs)

    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", Recording)
    return calls


def _storage_config(extra: dict[str, Any] | None, ranks: dict[str, int]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=ranks.get("tp_rank", 0),
        tp_size=ranks.get("tp_size", 1),
        pp_rank=ranks.get("pp_rank", 0),
        pp_size=ranks.get("pp_size", 1),
        attn_cp_rank=ranks.get("attn_cp_rank", 0),
        attn_cp_size=ranks.get("attn_cp_size", 1),
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="parity-model",
        dp_rank=ranks.get("dp_rank", 0),
        extra_config=extra,
    )


def _build(kind: str, storage_config: Any) -> str | None:
    """Construct one backend and close it; the error text if construction failed."""
    if kind == "sglang":
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

        factory = lambda: MooncakeStore(storage_config, None)  # noqa: E731
    else:
        from mooncake_span.sglang_backend import MooncakeSpanStore

        factory = lambda: MooncakeSpanStore(storage_config, {})  # noqa: E731
    try:
        store = factory()
    except Exception as exc:  # noqa: BLE001 - both must fail alike; the text is reported
        return repr(exc)
    store.close()
    return None


# (id, config keys, ranks, source)
CASES = [
    ("tp1-int-size-defaults", {"global_segment_size": 64 << 20}, {}, "extra"),
    (
        "tp8-rank3-text-size-str-keys-tenant-ssd",
        {
            "global_segment_size": "1gb",
            "device_name": json.dumps(NICS8),
            "tenant_id": "team-a",
            "enable_ssd_offload": True,
            "ssd_offload_path": "{tmp}/ssd",
        },
        {"tp_rank": 3, "tp_size": 8},
        "extra",
    ),
    (
        "tp8-rank6-int-keys",
        {"global_segment_size": "1GB", "device_name": NICS8_INT_KEYS},
        {"tp_rank": 6, "tp_size": 8},
        "extra",
    ),
    (
        "tp8-rank5-missing-from-map-blank-tenant",
        {"global_segment_size": 1 << 30, "device_name": NICS_MISSING_5, "tenant_id": "  "},
        {"tp_rank": 5, "tp_size": 8},
        "extra",
    ),
    (
        "tp4-pp2-dp1-ssd-path-only",
        {"global_segment_size": "1gb", "ssd_offload_path": "{tmp}/ssd"},
        {"tp_rank": 2, "tp_size": 4, "pp_rank": 1, "pp_size": 2, "dp_rank": 1},
        "extra",
    ),
    ("check-server", {"global_segment_size": 0, "check_server": True}, {}, "extra"),
    (
        "file-tp8-tenant-ssd",
        {
            "global_segment_size": "1gb",
            "device_name": json.dumps(NICS8),
            "tenant_id": "team-b",
            "enable_ssd_offload": True,
            "ssd_offload_path": "{tmp}/ssd",
        },
        {"tp_rank": 7, "tp_size": 8},
        "file",
    ),
    (
        "env-tp8-tenant-ssd",
        {
            "global_segment_size": "1gb",
            "device_name": json.dumps(NICS8),
            "tenant_id": "team-c",
            "enable_ssd_offload": True,
            "ssd_offload_path": "{tmp}/ssd",
        },
        {"tp_rank": 1, "tp_size": 8},
        "env",
    ),
    ("env-tp1-defaults", {"global_segment_size": "0"}, {}, "env"),
]

_ENV_OF_KEY = {
    "master_server_address": "MOONCAKE_MASTER",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "master_metrics_port": "MOONCAKE_MASTER_METRICS_PORT",
    "check_server": "MOONCAKE_CHECK_SERVER",
    "enable_ssd_offload": "MOONCAKE_ENABLE_SSD_OFFLOAD",
    "ssd_offload_path": "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
    "tenant_id": "MOONCAKE_TENANT_ID",
}


def _cluster_keys(mooncake_cluster: Any) -> dict[str, Any]:
    config = dict(mooncake_cluster.client_config())
    admin = config.pop("span_master_admin_url", None)
    config.pop("global_segment_size", None)
    if admin is not None:
        # The admin port travels as sglang's own key: placement must use it too.
        config["master_metrics_port"] = urllib.parse.urlsplit(admin).port
    return config


@pytest.fixture(scope="module")
def offload_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A master started with --enable_offload: without it SSD offload setups fail (-1300)."""
    from mooncake_span.ops.cluster import ClusterSpec, LocalCluster
    from tests.conftest import require_mooncake

    require_mooncake(need_binaries=True)
    spec = ClusterSpec(
        master_extra_args=("--enable_offload=true",),
        log_dir=tmp_path_factory.mktemp("offload-cluster"),
    )
    with LocalCluster(spec) as cluster:
        yield cluster


SSD_CASES = [c for c in CASES if c[1].get("enable_ssd_offload")]


@pytest.mark.parametrize(
    ("keys", "ranks", "source"), [c[1:] for c in SSD_CASES], ids=[c[0] for c in SSD_CASES]
)
def test_ssd_offload_sets_up_alike_on_an_offload_master(
    keys, ranks, source, offload_cluster, recorded_setups, monkeypatch, tmp_path
):
    errors = _run_case(keys, ranks, source, offload_cluster, recorded_setups, monkeypatch, tmp_path)
    assert errors == (None, None)
    # Both made the same per-rank directory under the configured path (beside it, our
    # lock of that directory: store/ssd_tier.py).
    (rank_dir,) = [p for p in (tmp_path / "ssd").iterdir() if p.is_dir()]
    assert rank_dir.name == "rank_0_{tp_rank}_0_0".format(**ranks)


@pytest.mark.parametrize(
    ("keys", "ranks", "source"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_same_setup_arguments_as_sglang(
    keys, ranks, source, mooncake_cluster, recorded_setups, monkeypatch, tmp_path
):
    sglang_error, ours_error = _run_case(
        keys, ranks, source, mooncake_cluster, recorded_setups, monkeypatch, tmp_path
    )
    # This master runs without --enable_offload: SSD offload fails setup (-1300) for both.
    if not keys.get("enable_ssd_offload"):
        assert sglang_error is None and ours_error is None, (sglang_error, ours_error)


def _run_case(keys, ranks, source, mooncake_cluster, recorded_setups, monkeypatch, tmp_path):
    """Build both backends from one input; assert the same setup arguments; return both errors."""
    for name, value in mooncake_cluster.client_env().items():
        monkeypatch.setenv(name, value)
    for name in _ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    for name in SsdTier("/", 1 << 30, 1 << 20).native_env():
        # Our SSD tier exports these into the process it serves; undone after the test.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    # Both clients' close() joins the offload heartbeat: 1 s apart, not Mooncake's 10.
    monkeypatch.setenv(HEARTBEAT_ENV, "1")
    base = _cluster_keys(mooncake_cluster)
    if keys.get("check_server") and "master_metrics_port" not in base:
        pytest.skip("the cluster publishes no admin port")
    values = {**base, **keys}
    if "ssd_offload_path" in values:
        values["ssd_offload_path"] = values["ssd_offload_path"].format(tmp=tmp_path)
    extra: dict[str, Any] | None = None
    if source == "extra":
        extra = values
    elif source == "file":
        path = tmp_path / "mooncake.json"
        path.write_text(json.dumps(values), encoding="utf-8")
        monkeypatch.setenv(CONFIG_PATH_ENV, str(path))
    else:
        for key, value in values.items():
            monkeypatch.setenv(
                _ENV_OF_KEY[key], str(value).lower() if value is True else str(value)
            )
    config = _storage_config(extra, ranks)

    sglang_error = _build("sglang", config)
    ours_error = _build("ours", config)

    # One setup each (sglang's warmup and our probe do not set up again).
    assert len(recorded_setups) == 2, recorded_setups
    theirs, ours = recorded_setups
    assert ours == theirs
    assert (sglang_error is None) == (ours_error is None), (sglang_error, ours_error)
    return sglang_error, ours_error


def test_master_metrics_port_alone_feeds_placement(mooncake_cluster, monkeypatch, key_namespace):
    """Without span_master_admin_url the segment list comes from master_metrics_port."""
    from mooncake_span.sglang_backend import MooncakeSpanStore

    for name, value in mooncake_cluster.client_env().items():
        monkeypatch.setenv(name, value)
    base = _cluster_keys(mooncake_cluster)
    if "master_metrics_port" not in base:
        pytest.skip("the cluster publishes no admin port")
    store = MooncakeSpanStore(_storage_config({**base, "global_segment_size": 0}, {}), {})
    try:
        assert store.options.master_admin_url is None
        assert store.client.segments(), "placement found no segment on master_metrics_port"
    finally:
        store.close()
    wrong = {**base, "global_segment_size": 0, "master_metrics_port": 1}
    store = MooncakeSpanStore(_storage_config(wrong, {}), {})
    try:
        assert store.client.segments() == ()
    finally:
        store.close()
