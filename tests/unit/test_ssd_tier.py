"""The SSD tier's settings and checks at start, without a cluster.

Every bad input is refused with the fix in the message, before the native
client starts, and nothing already in the directory is touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_span.errors import ConfigError, SetupError
from mooncake_span.mooncake_settings import MooncakeSettings
from mooncake_span.ops import doctor_ssd
from mooncake_span.ops.doctor_host import FAIL, PASS, SKIP, Context
from mooncake_span.store import serving_ssd, ssd_tier
from tests.span_helpers import FakeClock

MIB = 1 << 20
# Not writable even for root: os.access says yes, creating a file says no.
READ_ONLY_DIR = "/sys/kernel"


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


# ---- the native settings ------------------------------------------------------------


def test_the_tier_persists_every_object_up_to_the_segment_under_a_fifo_cap(tmp_path):
    tier = ssd_tier.SsdTier(str(tmp_path), cap_bytes=64 * MIB, largest_object_bytes=16 * MIB)
    env = tier.native_env()
    assert env == {
        ssd_tier.LAYOUT_ENV: "bucket_storage_backend",
        ssd_tier.KEYS_PER_BUCKET_ENV: "1",
        ssd_tier.BUCKET_BYTES_ENV: str(16 * MIB),
        ssd_tier.CAP_ENV: str(64 * MIB),
        ssd_tier.EVICTION_ENV: "fifo",
        ssd_tier.HEARTBEAT_ENV: "1",
        ssd_tier.READ_BUFFER_ENV: str(ssd_tier.DEFAULT_READ_BUFFER_BYTES),
    }
    assert ssd_tier.layout_problems(env, 16 * MIB) == []


@pytest.mark.parametrize(
    ("env", "fix"),
    [
        ({}, "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT=1"),  # Mooncake's defaults: nothing reaches disk
        ({"MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "4"}, "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT=1"),
        (
            {"MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "1", ssd_tier.BUCKET_BYTES_ENV: str(MIB)},
            f"at least {16 * MIB}",
        ),
        ({ssd_tier.LAYOUT_ENV: "file_per_key_storage_backend"}, "does not enforce its disk cap"),
        ({ssd_tier.LAYOUT_ENV: "nvme_kv_storage_backend"}, "unset it"),
    ],
)
def test_layouts_that_keep_objects_off_the_disk_are_named(env, fix):
    problems = ssd_tier.layout_problems(env, 16 * MIB)
    assert problems and fix in " ".join(problems)


def test_a_cap_below_one_object_is_refused():
    with pytest.raises(ConfigError, match="at least 16777216 bytes"):
        ssd_tier.SsdTier("/ssd", cap_bytes=MIB, largest_object_bytes=16 * MIB)
    ssd_tier.SsdTier("/ssd", cap_bytes=16 * MIB, largest_object_bytes=16 * MIB)


# ---- the directory -------------------------------------------------------------------


def test_bad_directories_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist; create it .*mkdir -p"):
        ssd_tier.check_root(str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()  # never created for the operator
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="symbolic link.*pass the directory it points to"):
        ssd_tier.check_root(str(tmp_path / "link"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        ssd_tier.check_root(str(tmp_path / "file"))
    if os.path.isdir(READ_ONLY_DIR):
        with pytest.raises(ConfigError, match="not writable.*chown"):
            ssd_tier.check_root(READ_ONLY_DIR)
    assert ssd_tier.check_root(str(tmp_path / "real")) == str(tmp_path / "real")
    assert os.listdir(tmp_path / "real") == []  # the write probe leaves nothing behind


def test_a_node_directory_that_is_a_symlink_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "node0").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="symbolic link"):
        ssd_tier.process_dir(str(tmp_path), "node0")
    with pytest.raises(ConfigError, match="cannot name a sub-directory"):
        ssd_tier.process_dir(str(tmp_path), "../up")
    assert ssd_tier.process_dir(str(tmp_path), "node1") == str(tmp_path / "node1")


def test_a_directory_in_use_is_refused_and_a_crash_is_remembered(tmp_path):
    first = ssd_tier.DirLock(str(tmp_path), "node0")
    assert first.acquire("node0") == {}
    first.update(state="running", segment="127.0.0.1:12345")
    with pytest.raises(
        ConfigError, match=r"in use by another running process \(pid \d+, segment 127.0.0.1:12345\)"
    ):
        ssd_tier.DirLock(str(tmp_path), "node0").acquire("node0")
    with pytest.raises(ConfigError, match="--node-name"):
        ssd_tier.DirLock(str(tmp_path), "node0").check_free("node0")
    ssd_tier.DirLock(str(tmp_path), "node1").check_free("node1")  # another name: free
    # A crash: the lock goes with the process, the record stays "running".
    os.close(first._fd)
    first._fd = None
    again = ssd_tier.DirLock(str(tmp_path), "node0")
    previous = again.acquire("node0")
    assert previous["segment"] == "127.0.0.1:12345" and ssd_tier.crashed(previous)
    again.release()
    assert not ssd_tier.crashed(ssd_tier.DirLock(str(tmp_path), "node0").acquire("node0"))


def test_a_restart_after_a_crash_waits_until_the_master_drops_the_old_owner():
    clock = FakeClock()
    listed = iter([["a:1", "old:1"], ["a:1", "old:1"], None, ["a:1"]])
    waited = ssd_tier.wait_for_owner_expiry(
        {"segment": "old:1"}, 10, lambda: next(listed), sleep=clock.advance, clock=clock
    )
    assert waited == pytest.approx(1.5)
    # A new master never knew the old owner: no wait.
    assert (
        ssd_tier.wait_for_owner_expiry(
            {"segment": "old:1"}, 10, lambda: ["a:1"], sleep=clock.advance, clock=clock
        )
        == 0
    )
    # Without the segment list, the whole client TTL (plus the margin).
    waited = ssd_tier.wait_for_owner_expiry(
        {"segment": "old:1"}, 10, None, sleep=clock.advance, clock=clock
    )
    assert waited == pytest.approx(10 + ssd_tier.EXPIRY_MARGIN_S)
    # Bounded even if the master keeps listing it.
    waited = ssd_tier.wait_for_owner_expiry(
        {"segment": "old:1"}, 3, lambda: ["old:1"], sleep=clock.advance, clock=clock
    )
    assert waited < 3 + ssd_tier.EXPIRY_MARGIN_S + 1


# ---- a serving rank with sglang's enable_ssd_offload ---------------------------------


def test_a_serving_rank_gets_the_same_settings_but_the_operators_win(tmp_path):
    env = {ssd_tier.READ_BUFFER_ENV: str(64 * MIB), ssd_tier.CAP_ENV: str(256 * MIB)}
    lock = serving_ssd.open_serving_tier(
        str(tmp_path / "ssd" / "rank_0_0_0_0"), 16 * MIB, env, None
    )
    try:
        assert env[ssd_tier.KEYS_PER_BUCKET_ENV] == "1"
        assert env[ssd_tier.READ_BUFFER_ENV] == str(64 * MIB)
        assert env[ssd_tier.CAP_ENV] == str(256 * MIB)
        assert (tmp_path / "ssd" / "rank_0_0_0_0").is_dir()
        with pytest.raises(ConfigError, match="in use"):
            serving_ssd.open_serving_tier(
                str(tmp_path / "ssd" / "rank_0_0_0_0"), 16 * MIB, {}, None
            )
    finally:
        lock.release()
    with pytest.raises(ConfigError, match="persist nothing.*KEYS_LIMIT=1"):
        serving_ssd.open_serving_tier(
            str(tmp_path / "ssd" / "rank_0_1_0_0"),
            16 * MIB,
            {ssd_tier.KEYS_PER_BUCKET_ENV: "500"},
            None,
        )


def test_a_bad_stop_wait_refuses_the_rank_and_frees_its_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(ssd_tier.STOP_WAIT_ENV, "soon")
    root = tmp_path / "ssd"
    for name in ssd_tier.SsdTier(str(root), MIB, MIB).native_env():
        # setenv first, so the undo also removes what the rank's set-up exports
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    settings = MooncakeSettings(
        master_server_address="127.0.0.1:1",
        global_segment_size_bytes=16 * MIB,
        enable_ssd_offload=True,
        ssd_offload_path=str(root / "rank_0_0_0_0"),
    )
    ssd = serving_ssd.ServingSsd(gate=None, ledger=None)
    with pytest.raises(SetupError, match=f"SSD tier: {ssd_tier.STOP_WAIT_ENV}"):
        with ssd.opened(settings, None, lambda _url: None, lambda _url, _keys: None):
            pytest.fail("setup ran with a bad stop wait")
    ssd_tier.DirLock(str(root), "rank_0_0_0_0").check_free("the rank's directory")


def test_a_rank_without_a_usable_directory_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", raising=False)
    ssd = serving_ssd.ServingSsd(gate=None, ledger=None)

    def open_with(path):
        settings = MooncakeSettings(
            master_server_address="127.0.0.1:1", enable_ssd_offload=True, ssd_offload_path=path
        )
        with ssd.opened(settings, None, lambda _url: None, lambda _url, _keys: None):
            pytest.fail("setup ran without a usable SSD directory")

    with pytest.raises(SetupError, match="enable_ssd_offload needs a directory"):
        open_with(None)
    (tmp_path / "file").write_text("")
    with pytest.raises(SetupError, match=r"SSD tier \(.*rank_0\): .*File exists"):
        open_with(str(tmp_path / "file" / "rank_0"))
    assert not ssd.owns_directory


# ---- the storage node's flags --------------------------------------------------------


def _node(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "mooncake_span.storage_node", "--master=127.0.0.1:1"]
    return subprocess.run(
        [*argv, "--segment-bytes=16mb", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (lambda d: d / "missing", [], "does not exist; create it"),
        (lambda d: d / "link", [], "symbolic link"),
        (lambda d: Path(READ_ONLY_DIR), [], "not writable"),
        (lambda d: d / "ssd", ["--ssd-size=1mb"], "smaller than one object"),
        (lambda d: d / "ssd", ["--node-name=../x"], "cannot name a sub-directory"),
        (lambda d: d / "ssd", ["--ssd-read-buffer=4kb"], "at least 1mb"),
    ],
)
def test_storage_node_refuses_bad_ssd_input_before_starting(tmp_path, make, args, message):
    (tmp_path / "ssd" / "node0").mkdir(parents=True)
    (tmp_path / "ssd" / "node0" / "bucket-1.bin").write_bytes(b"cached")
    (tmp_path / "link").symlink_to(tmp_path / "ssd")
    before = _tree(tmp_path / "ssd")
    result = _node(f"--ssd-dir={make(tmp_path)}", "--node-name=node0", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert _tree(tmp_path / "ssd") == before  # nothing on disk deleted or rewritten


def test_storage_node_refuses_a_directory_another_node_runs_on(tmp_path):
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "bucket-1.bin").write_bytes(b"cached")
    holder = ssd_tier.DirLock(str(tmp_path), "node0")
    holder.acquire("node0")
    try:
        result = _node(f"--ssd-dir={tmp_path}", "--node-name=node0")
    finally:
        holder.release()
    assert result.returncode == 2
    assert "in use by another running process" in result.stderr
    assert (tmp_path / "node0" / "bucket-1.bin").read_bytes() == b"cached"


def test_ssd_flags_need_the_directory():
    result = _node("--ssd-size=1gb")
    assert result.returncode == 2 and "--ssd-size needs --ssd-dir" in result.stderr


# ---- doctor ------------------------------------------------------------------------------


def _ctx(ssd_dir: str | None = None, **settings) -> Context:
    base = dict(
        master_server_address="127.0.0.1:50051",
        metadata_server="http://127.0.0.1:8080/metadata",
        local_hostname="127.0.0.1",
        protocol="tcp",
        global_segment_size_bytes=0,
    )
    return Context(settings=MooncakeSettings(**{**base, **settings}), ssd_dir=ssd_dir)


def test_doctor_skips_without_an_ssd_tier():
    assert [c.status for c in doctor_ssd.check_ssd(_ctx())] == [SKIP]


def test_doctor_fails_offload_on_a_rank_without_a_segment(tmp_path):
    (check,) = doctor_ssd.check_ssd(
        _ctx(enable_ssd_offload=True, ssd_offload_path=str(tmp_path / "rank_0_0_0_0"))
    )
    assert check.status == FAIL and "persists nothing" in check.detail
    assert "--ssd-dir" in check.fix


def test_doctor_fails_a_layout_that_persists_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(ssd_tier.KEYS_PER_BUCKET_ENV, "500")
    ctx = _ctx(
        enable_ssd_offload=True,
        ssd_offload_path=str(tmp_path / "rank_0_0_0_0"),
        global_segment_size_bytes=64 * MIB,
    )
    (check,) = doctor_ssd.check_ssd(ctx)
    assert check.status == FAIL and "persist nothing" in check.detail
    assert check.fix == f"set {ssd_tier.KEYS_PER_BUCKET_ENV}=1"
    monkeypatch.delenv(ssd_tier.KEYS_PER_BUCKET_ENV)
    assert [c.status for c in doctor_ssd.check_ssd(ctx)] == [PASS]


def test_doctor_checks_a_storage_nodes_directory(tmp_path):
    assert [c.status for c in doctor_ssd.check_ssd(_ctx(str(tmp_path)))] == [PASS]
    (check,) = doctor_ssd.check_ssd(_ctx(str(tmp_path / "missing")))
    assert check.status == FAIL and "mkdir -p" in check.detail


@pytest.mark.parametrize(
    ("segment", "flag", "free_mib", "status"),
    [
        (64 * MIB, 0, 63, FAIL),  # usable space one MiB short of the node's segment
        (64 * MIB, 0, 64, PASS),
        (0, 64 * MIB, 63, FAIL),  # --segment-bytes names it where the config does not
        (512 * MIB, 64 * MIB, 64, PASS),  # ... and wins over the config's
        (0, 0, 15, FAIL),  # unknown: Mooncake's smallest segment, 16 MiB
        (0, 0, 16, PASS),
        (64 * MIB, 0, 0, FAIL),
    ],
)
def test_doctor_fails_a_directory_that_cannot_hold_one_object(
    tmp_path, monkeypatch, segment, flag, free_mib, status
):
    """What the docs say and the storage node does: usable capacity (free space plus
    what the directory holds, less the reserve) below one object fails, naming both."""
    monkeypatch.setattr(
        ssd_tier, "free_bytes", lambda _d: ssd_tier.DISK_RESERVE_BYTES + free_mib * MIB
    )
    ctx = _ctx(str(tmp_path), global_segment_size_bytes=segment)
    ctx.ssd_segment_bytes = flag
    (check,) = doctor_ssd.check_ssd(ctx)
    assert check.status == status, check.detail
    object_bytes = flag or segment or doctor_ssd.SMALLEST_SEGMENT_BYTES
    assert check.data["object_bytes"] == object_bytes
    assert f"{free_mib * MIB} bytes usable" in check.detail
    assert f"one object of up to {object_bytes} bytes" in check.detail
    assert ("not known" in check.detail) == (not flag and not segment)


def test_doctor_names_the_master_flag_when_the_master_refuses_offload():
    check = doctor_ssd.master_check({"setup_rc": -1300, "error": "setup returned -1300"})
    assert check.status == FAIL and "--enable_offload=true" in check.fix
    assert doctor_ssd.master_check({"setup_rc": 0}).status == PASS
    assert doctor_ssd.master_check({"error": "no answer"}).status == SKIP


class _Clock:
    """A clock that a sleep moves by what it sleeps; ``changes`` are the times at which the
    directory's stamp changes."""

    def __init__(self, changes: list[float]) -> None:
        self.now_s = 0.0
        self.changes = changes

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds

    def stamp(self) -> int:
        return sum(1 for at in self.changes if at <= self.now_s)


def _wait(clock: _Clock, limit_s: float = 20.0, quiet_s: float = 2.0) -> bool:
    return ssd_tier.wait_offloads_written(
        "/unused", limit_s, quiet_s, stamp=clock.stamp, clock=lambda: clock.now_s, sleep=clock.sleep
    )


def test_a_stop_waits_two_heartbeats_even_when_nothing_changes():
    clock = _Clock(changes=[])
    assert _wait(clock)
    assert 2.0 <= clock.now_s < 2.1


def test_a_stop_waits_until_the_directory_is_quiet_after_its_last_write():
    clock = _Clock(changes=[0.8, 1.9, 3.4])  # the heartbeats writing what the node held
    assert _wait(clock)
    assert 5.4 <= clock.now_s < 5.5


def test_a_stop_gives_up_at_its_bound_while_offloads_keep_coming():
    clock = _Clock(changes=[0.5 * i for i in range(1, 100)])
    assert not _wait(clock, limit_s=5.0)
    assert 5.0 <= clock.now_s < 5.1


def test_a_stop_with_no_wait_returns_at_once():
    clock = _Clock(changes=[])
    assert not _wait(clock, limit_s=0.0)
    assert clock.now_s == 0.0


def test_the_quiet_spell_is_two_of_the_heartbeats_the_process_runs():
    assert ssd_tier.offload_quiet_s({}) == 2.0 * ssd_tier.HEARTBEAT_S
    assert ssd_tier.offload_quiet_s({ssd_tier.HEARTBEAT_ENV: "10"}) == 20.0


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        (None, None, ssd_tier.DEFAULT_STOP_WAIT_S),
        (None, "5", 5.0),
        (3.0, "5", 3.0),
        (0.0, None, 0.0),
    ],
)
def test_the_stop_wait_comes_from_the_flag_then_the_environment(flag, env, expected):
    environ = {} if env is None else {ssd_tier.STOP_WAIT_ENV: env}
    assert ssd_tier.resolve_stop_wait_s(flag, environ) == expected


@pytest.mark.parametrize(
    ("flag", "env"), [(-1.0, None), (None, "soon"), (None, "inf"), (None, "-2")]
)
def test_a_bad_stop_wait_is_refused_naming_where_it_came_from(flag, env):
    environ = {} if env is None else {ssd_tier.STOP_WAIT_ENV: env}
    with pytest.raises(
        ConfigError, match="--ssd-stop-wait-s" if flag is not None else ssd_tier.STOP_WAIT_ENV
    ):
        ssd_tier.resolve_stop_wait_s(flag, environ)


def test_a_stop_whose_directory_is_gone_does_not_wait_or_raise(tmp_path):
    assert not ssd_tier.wait_offloads_written(str(tmp_path / "gone"), 20.0, 2.0)
