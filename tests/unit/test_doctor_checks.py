"""doctor's local checks and the shared connection resolution, without a cluster."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
from pathlib import Path

import pytest

from mooncake_span.errors import ConfigError
from mooncake_span.mooncake_settings import MooncakeSettings
from mooncake_span.ops import doctor, doctor_host
from mooncake_span.ops.cli_common import add_connection_args, resolve_settings

REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_connection_args(parser)
    return parser.parse_args(list(argv))


def _ctx(**settings) -> doctor.Context:
    base = dict(
        master_server_address="127.0.0.1:50051",
        metadata_server="http://127.0.0.1:8080/metadata",
        local_hostname="127.0.0.1",
        protocol="tcp",
        global_segment_size_bytes=0,
    )
    return doctor.Context(settings=MooncakeSettings(**{**base, **settings}))


# ---- connection resolution ---------------------------------------------------------


def test_flags_alone_make_a_tcp_config():
    settings, _ = resolve_settings(
        _args("--master", "127.0.0.1:1", "--metadata", "P2PHANDSHAKE"), environ={}
    )
    assert (settings.master_server_address, settings.protocol) == ("127.0.0.1:1", "tcp")
    assert settings.source == "command line"


def test_flags_override_the_extra_config_and_keep_its_other_keys(tmp_path):
    path = tmp_path / "extra.json"
    path.write_text(
        json.dumps(
            {
                "master_server_address": "10.0.0.1:50051",
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "global_segment_size": "1gb",
            }
        )
    )
    settings, extra = resolve_settings(
        _args("--extra-config", f"@{path}", "--master", "127.0.0.1:2"), environ={}
    )
    assert settings.master_server_address == "127.0.0.1:2"
    assert settings.global_segment_size_bytes == 1 << 30
    assert "command line" in settings.source
    assert extra["protocol"] == "tcp"


def test_environment_source_is_read_like_the_backend():
    env = {"MOONCAKE_MASTER": "127.0.0.1:3", "MOONCAKE_PROTOCOL": "tcp"}
    settings, _ = resolve_settings(_args(), environ=env)
    assert settings.master_server_address == "127.0.0.1:3"
    assert settings.source == "environment"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "no Mooncake master configured"),
        (("--extra-config", "{not json"), "not valid JSON"),
        (("--extra-config", "[1]"), "must be a JSON object"),
        (("--extra-config", "@/nonexistent/x.json"), "cannot read --extra-config"),
        (("--master", "nohostport"), "invalid master address"),
        (("--master", "127.0.0.1:1", "--metadata", "foo://x"), "not supported"),
    ],
)
def test_bad_config_is_named(argv, message):
    with pytest.raises(ConfigError, match=message):
        resolve_settings(_args(*argv), environ={})


def test_config_failure_is_one_fail_line(monkeypatch):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    doctor.register(sub)
    for name in ("MOONCAKE_MASTER", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
        monkeypatch.delenv(name, raising=False)
    checks, _ = doctor.run_checks(parser.parse_args(["doctor", "--native-log", "-"]))
    assert [(c.name, c.status) for c in checks] == [("config", "FAIL")]
    assert "MOONCAKE_MASTER" in checks[0].detail


# ---- bind address -------------------------------------------------------------------


def test_bind_unset_warns_with_the_export_line(monkeypatch):
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)
    (check,) = doctor.check_bind(_ctx())
    assert check.status == "WARN" and "export MC_TCP_BIND_ADDRESS=127.0.0.1" in check.fix


def test_bind_matching_local_hostname_passes(monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    (check,) = doctor.check_bind(_ctx())
    assert check.status == "PASS"


def test_bind_mismatch_fails_naming_both(monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    (check,) = doctor.check_bind(_ctx(local_hostname="127.0.0.2"))
    assert check.status == "FAIL"
    assert "127.0.0.2" in check.detail and "127.0.0.1" in check.detail


def test_bind_to_a_foreign_address_fails(monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "192.0.2.77")  # TEST-NET-1, never local
    (check,) = doctor.check_bind(_ctx(local_hostname="192.0.2.77"))
    assert check.status == "FAIL" and "not an address of this host" in check.detail


def test_loopback_bind_with_a_remote_master_fails(monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    (check,) = doctor.check_bind(_ctx(master_server_address="192.0.2.10:50051"))
    assert check.status == "FAIL" and "remote" in check.detail


# ---- host checks --------------------------------------------------------------------


@pytest.mark.parametrize(("value", "status"), [("1", "PASS"), ("2", "PASS"), ("6", "WARN")])
def test_syn_retries(monkeypatch, tmp_path, value, status):
    path = tmp_path / "tcp_syn_retries"
    path.write_text(value + "\n")
    monkeypatch.setattr(doctor, "_SYN_RETRIES_PATH", str(path))
    (check,) = doctor.check_syn_retries(_ctx())
    assert check.status == status
    assert check.fix is None if status == "PASS" else "tcp_syn_retries=1" in check.fix


def test_segment_larger_than_memory_fails():
    (check,) = doctor.check_memory(_ctx(global_segment_size_bytes=1 << 50))
    assert check.status == "FAIL" and check.data["need_bytes"] > check.data["available_bytes"]
    (check,) = doctor.check_memory(_ctx(global_segment_size_bytes=0))
    assert check.status == "PASS"


def test_rdma_without_devices_fails(tmp_path):
    ctx = _ctx(protocol="rdma", device_name="mlx5_0")
    ctx.ib_path = str(tmp_path / "none")
    checks = doctor.check_device(ctx)
    assert checks[0].status == "FAIL" and "mlx5_0" in checks[0].detail
    assert "no device" in checks[0].detail and str(tmp_path / "none") in checks[0].detail
    assert {c.name for c in checks} == {"rdma device", "hugepages"}


def test_rdma_with_the_named_device_passes(tmp_path):
    (tmp_path / "mlx5_0").mkdir()
    ctx = _ctx(protocol="rdma", device_name="mlx5_0")
    ctx.ib_path = str(tmp_path)
    checks = doctor.check_device(ctx)
    assert checks[0].status == "PASS"


def test_this_hosts_sys_class_infiniband_is_reported_as_it_is():
    # This machine has no RDMA NIC: the real root must say so, not pass.
    ctx = _ctx(protocol="rdma", device_name="mlx5_0")
    (check, *_) = doctor.check_device(ctx)
    root = doctor_host._IB_PATH
    present = sorted(os.listdir(root)) if os.path.isdir(root) else []
    assert check.status == ("PASS" if "mlx5_0" in present else "FAIL")
    assert check.data["present"] == present


def _tp8_doctor(tmp_path, device_map, tp_rank, nics):
    for nic in nics:
        (tmp_path / nic).mkdir()
    extra = {
        "master_server_address": "127.0.0.1:50051",
        "protocol": "rdma",
        "device_name": json.dumps(device_map),
        "global_segment_size": "8gb",
        "master_metrics_port": 9111,
    }
    args = _doctor_args(
        "--extra-config", json.dumps(extra), "--tp-size", "8", "--tp-rank", str(tp_rank)
    )
    return args


def _doctor_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    doctor.register(sub)
    return parser.parse_args(["doctor", *argv])


def _resolve_ctx(args, ib_path):
    from mooncake_span.mooncake_settings import RankInfo

    ctx = doctor.Context()
    ctx.ranks = RankInfo(tp_rank=args.tp_rank, tp_size=args.tp_size, pp_size=args.pp_size)
    ctx.local_ranks = args.local_ranks or ctx.ranks.ranks_per_server
    ctx.settings, ctx.extra = resolve_settings(args, environ={}, ranks=ctx.ranks)
    ctx.rank_devices = doctor._local_rank_devices(args, ctx)
    ctx.ib_path = str(ib_path)
    return ctx


def test_the_nic_of_this_rank_comes_from_the_map(tmp_path):
    device_map = {str(r): f"mlx5_{r}" for r in range(8)}
    args = _tp8_doctor(tmp_path, device_map, 3, ["mlx5_3"])
    ctx = _resolve_ctx(args, tmp_path)
    assert ctx.settings.device_name == "mlx5_3"
    assert ctx.settings.global_segment_size_bytes == 1 << 30
    checks = doctor.check_device(ctx)
    assert checks[0].status == "PASS" and "tp_rank 3" in checks[0].detail
    # The other seven local ranks' NICs are not on this (test) host.
    others = next(c for c in checks if c.name == "rdma device (other ranks)")
    assert others.status == "WARN" and sorted(others.data["absent"]) == [0, 1, 2, 4, 5, 6, 7]


def test_a_rank_the_map_leaves_out_warns_and_a_missing_nic_fails(tmp_path):
    args = _tp8_doctor(tmp_path, {"0": "mlx5_0"}, 5, ["mlx5_0"])
    (check, *_) = doctor.check_device(_resolve_ctx(args, tmp_path))
    assert check.status == "WARN" and "leaves this rank" in check.detail
    args = _tp8_doctor(tmp_path, {"5": "mlx5_9"}, 5, [])
    (check, *_) = doctor.check_device(_resolve_ctx(args, tmp_path))
    assert check.status == "FAIL" and "mlx5_9" in check.detail and "tp_rank 5" in check.detail


def test_memory_counts_every_local_rank(tmp_path):
    args = _tp8_doctor(tmp_path, {}, 0, [])
    ctx = _resolve_ctx(args, tmp_path)
    (check,) = doctor.check_memory(ctx)
    per_rank = (1 << 30) + (16 << 20)
    assert check.data["per_rank_bytes"] == per_rank
    assert check.data["need_bytes"] == 8 * per_rank and "x 8 local ranks" in check.detail
    ctx.local_ranks, ctx.host_pool_bytes = 2, 4 << 30
    (check,) = doctor.check_memory(ctx)
    assert check.data["need_bytes"] == 2 * (per_rank + (4 << 30))


@pytest.mark.parametrize(
    ("limit", "status"), [(64 << 10, "FAIL"), (1 << 40, "PASS"), (resource.RLIM_INFINITY, "PASS")]
)
def test_memlock_against_what_one_rank_registers(monkeypatch, limit, status):
    monkeypatch.setattr(doctor_host.resource, "getrlimit", lambda _which: (limit, limit))
    ctx = _ctx(protocol="rdma", global_segment_size_bytes=1 << 30)
    ctx.host_pool_bytes = 2 << 30
    ctx.staging_bytes = 64 << 20
    (check,) = doctor.check_memlock(ctx)
    assert check.status == status
    assert check.data["need_bytes"] == (1 << 30) + (16 << 20) + (64 << 20) + (2 << 30)
    assert "staging 67108864" in check.detail
    assert (status == "FAIL") == ("ulimit -l" in (check.fix or ""))


def test_memlock_is_not_needed_over_tcp(monkeypatch):
    monkeypatch.setattr(doctor_host.resource, "getrlimit", lambda _which: (0, 0))
    (check,) = doctor.check_memlock(_ctx(protocol="tcp", global_segment_size_bytes=1 << 30))
    assert check.status == "PASS" and "tcp" in check.detail


def test_admin_port_comes_from_master_metrics_port_of_any_source(tmp_path):
    from mooncake_span.ops.cli_common import admin_url

    args = _tp8_doctor(tmp_path, {}, 0, [])
    ctx = _resolve_ctx(args, tmp_path)
    assert admin_url(args, ctx.settings, ctx.extra) == "http://127.0.0.1:9111"
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps({"master_server_address": "10.9.9.9:1", "master_metrics_port": 9222})
    )
    settings, extra = resolve_settings(
        _args(), environ={"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(path)}
    )
    assert admin_url(_args(), settings, extra) == "http://10.9.9.9:9222"
    env = {"MOONCAKE_MASTER": "10.8.8.8:1", "MOONCAKE_MASTER_METRICS_PORT": "9333"}
    settings, extra = resolve_settings(_args(), environ=env)
    assert admin_url(_args(), settings, extra) == "http://10.8.8.8:9333"


def test_store_checks_are_skipped_after_a_foundation_failure():
    ctx = _ctx()
    ctx.failed.add("master")
    round_trip, guard = doctor.check_store(ctx)
    assert round_trip.status == "FAIL" and "master failed" in round_trip.detail
    assert guard.status == "SKIP"


def test_text_format_prints_the_fix_under_failures():
    text = doctor.format_text(
        [doctor.Check("a", "PASS", "fine", "unused"), doctor.Check("bb", "FAIL", "broken", "do x")]
    )
    assert text.splitlines() == ["PASS  a   fine", "FAIL  bb  broken", "          fix: do x"]


# ---- scripts/setup.sh's pip filter -------------------------------------------------------


def _filter(tmp_path: Path, text: str) -> str:
    log = tmp_path / "pip.log"
    log.write_text(text)
    script = f"source {REPO / 'scripts/lib/pip_quiet.sh'}; filter_pip_stderr {log}"
    return subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=30, check=True
    ).stdout


HEADER = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages "
    "that are installed. This behaviour is the source of the following dependency conflicts.\n"
)


def test_expected_sglang_lines_become_one_line(tmp_path):
    out = _filter(
        tmp_path,
        HEADER
        + "sglang 0.5.23 requires anthropic, which is not installed.\n"
        + "sglang 0.5.23 requires xgrammar==0.1.27, but you have xgrammar 0.1.25 which is "
        "incompatible.\n",
    )
    assert out.splitlines() == [
        "setup: pip lists 2 sglang requirements as missing or different: expected, sglang is "
        "installed --no-deps with only the CPU subset in requirements/sglang-cpu.txt"
    ]


def test_real_errors_still_show(tmp_path):
    out = _filter(
        tmp_path,
        HEADER
        + "sglang 0.5.23 requires anthropic, which is not installed.\n"
        + "torch 2.13.0 requires sympy>=1.13, which is not installed.\n"
        + "ERROR: No matching distribution found for nonexistent-pkg\n",
    )
    assert "torch 2.13.0 requires sympy" in out
    assert "No matching distribution" in out
    assert "dependency resolver" in out  # the header belongs to the torch conflict
    assert "anthropic" not in out


def test_pip_quiet_keeps_the_exit_status(tmp_path):
    script = f"source {REPO / 'scripts/lib/pip_quiet.sh'}; pip_quiet sh -c 'echo boom >&2; exit 3'"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 3 and "boom" in result.stderr


def test_admin_url_sources_in_order():
    from mooncake_span.ops.cli_common import admin_url

    settings, _ = resolve_settings(_args("--master", "10.1.2.3:50051"), environ={})
    assert admin_url(_args(), settings, {}) == "http://10.1.2.3:9003"
    extra = {"master_metrics_port": 9100, "span_master_admin_url": "http://m:9200/"}
    assert admin_url(_args(), settings, extra) == "http://m:9200"
    assert admin_url(_args("--admin-url", "http://x:1/"), settings, extra) == "http://x:1"
    ha, _ = resolve_settings(_args("--master", "etcd://10.1.2.3:2379"), environ={})
    assert admin_url(_args(), ha, {}) is None
