"""doctor's local checks and the shared connection resolution, without a cluster."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from mooncake_span.config import MooncakeSettings
from mooncake_span.errors import ConfigError
from mooncake_span.ops import doctor
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


def test_rdma_without_devices_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(doctor, "_IB_PATH", str(tmp_path / "none"))
    checks = doctor.check_device(_ctx(protocol="rdma", device_name="mlx5_0"))
    assert checks[0].status == "FAIL" and "mlx5_0" in checks[0].detail
    assert {c.name for c in checks} == {"rdma device", "memlock", "hugepages"}


def test_rdma_with_the_named_device_passes(monkeypatch, tmp_path):
    (tmp_path / "mlx5_0").mkdir()
    monkeypatch.setattr(doctor, "_IB_PATH", str(tmp_path))
    checks = doctor.check_device(_ctx(protocol="rdma", device_name="mlx5_0"))
    assert checks[0].status == "PASS"


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
    assert admin_url(_args(), settings, {"master_metrics_port": 9100}) == "http://10.1.2.3:9100"
    extra = {"master_metrics_port": 9100, "span_master_admin_url": "http://m:9200/"}
    assert admin_url(_args(), settings, extra) == "http://m:9200"
    assert admin_url(_args("--admin-url", "http://x:1/"), settings, extra) == "http://x:1"
    ha, _ = resolve_settings(_args("--master", "etcd://10.1.2.3:2379"), environ={})
    assert admin_url(_args(), ha, {}) is None
