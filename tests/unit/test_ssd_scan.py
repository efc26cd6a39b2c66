"""The SSD directory check before Mooncake registers it (store/ssd_scan.py) and the
usable-capacity rule (store/ssd_tier.check_room), on files laid out as the
0.3.13.post1 wheel writes them (tests/integration/test_ssd_integrity.py runs
the real wheel's files)."""

from __future__ import annotations

import pytest

from mooncake_span.errors import ConfigError
from mooncake_span.store import seal, ssd_scan, ssd_tier

TENANT = b"default\0"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _write_pair(directory, bucket_id: int, key: str, data: bytes) -> None:
    stored_key = TENANT + key.encode()
    shape = _field(2, len(stored_key)) + _field(3, len(data))
    meta = _field(1, len(stored_key) + len(data)) + _field(2, stored_key) + _field(3, shape)
    (directory / f"{bucket_id}.meta").write_bytes(meta)
    (directory / f"{bucket_id}.bucket").write_bytes(stored_key + data)


def _sealed(key: str, payload: bytes) -> bytes:
    return payload + seal.trailer_bytes(key, payload)


def test_the_meta_parser_reads_what_the_wheel_wrote():
    # A .meta file the 0.3.13.post1 wheel wrote for a 1 MiB object "exp-0".
    real = bytes.fromhex("088d8040120d64656661756c74006578702d301a06100d18808040")
    total, entries = ssd_scan.parse_meta(real)
    assert total == 13 + (1 << 20)
    assert [(e.key, e.offset, e.key_bytes, e.data_bytes) for e in entries] == [
        (b"default\0exp-0", 0, 13, 1 << 20)
    ]
    with pytest.raises(ValueError):
        ssd_scan.parse_meta(real[:-3])


def test_torn_and_corrupt_objects_are_deleted_the_rest_kept(tmp_path):
    payload = bytes(range(256)) * 64
    _write_pair(tmp_path, 1, "good", _sealed("good", payload))
    _write_pair(tmp_path, 2, "plain", payload)  # no seal: cannot be checked, kept
    _write_pair(tmp_path, 3, "torn", _sealed("torn", payload))
    torn = tmp_path / "3.bucket"
    torn.write_bytes(torn.read_bytes()[:5000])
    rotted = bytearray(_sealed("rot", payload))
    rotted[1234] ^= 0x04
    _write_pair(tmp_path, 4, "rot", bytes(rotted))
    _write_pair(tmp_path, 5, "good~c1", _sealed("good", payload))  # a copy seals its key's
    (tmp_path / "6.meta").write_bytes(b"\xff\xff")  # unreadable: left to Mooncake
    report = ssd_scan.check_directory(str(tmp_path), "full")
    assert report.torn == ["torn"] and report.corrupt == ["rot"]
    assert report.checked_objects == 2 and report.unsealed_objects == 1
    assert report.unreadable_meta == 1
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["1.bucket", "1.meta", "2.bucket", "2.meta", "5.bucket", "5.meta", "6.meta"]


def test_size_mode_deletes_only_torn_files_and_off_nothing(tmp_path):
    payload = bytes(4096)
    rotted = bytearray(_sealed("rot", payload))
    rotted[10] ^= 1
    _write_pair(tmp_path, 1, "rot", bytes(rotted))
    _write_pair(tmp_path, 2, "torn", _sealed("torn", payload))
    (tmp_path / "2.bucket").write_bytes(b"")
    assert ssd_scan.check_directory(str(tmp_path), "off").removed == 0
    assert len(list(tmp_path.iterdir())) == 4
    report = ssd_scan.check_directory(str(tmp_path), "size")
    assert report.torn == ["torn"] and report.corrupt == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.bucket", "1.meta"]
    with pytest.raises(ConfigError, match="one of"):
        ssd_scan.check_directory(str(tmp_path), "quick")


def test_a_directory_that_cannot_hold_one_object_is_refused_naming_the_usable_bytes():
    reserve = ssd_tier.DISK_RESERVE_BYTES
    with pytest.raises(ConfigError, match=r"/ssd has 0 bytes usable .*256 MiB reserve"):
        ssd_tier.check_room(0, 1 << 30, 16 << 20, "/ssd")
    assert ssd_tier.check_room(1 << 30, 1 << 30, 16 << 20, "/ssd") is None
    warning = ssd_tier.check_room(100 << 20, 1 << 30, 16 << 20, "/ssd")
    assert warning is not None and f"{100 << 20} bytes usable" in warning
    assert reserve == 256 << 20


def test_usable_bytes_is_free_space_plus_what_it_holds_less_the_reserve(monkeypatch, tmp_path):
    monkeypatch.setattr(ssd_tier, "free_bytes", lambda _: 64 << 20)
    assert ssd_tier.usable_bytes(str(tmp_path)) == 0  # a 64 MiB disk: inside the reserve
    monkeypatch.setattr(ssd_tier, "free_bytes", lambda _: 300 << 20)
    assert ssd_tier.usable_bytes(str(tmp_path), held=10 << 20) == (310 - 256) << 20
    (tmp_path / "a").write_bytes(bytes(1000))
    assert ssd_tier.held_bytes(str(tmp_path)) == 1000


def test_size_mode_deletes_orphans_and_reads_no_object_bytes(tmp_path, monkeypatch):
    payload = bytes(4096)
    _write_pair(tmp_path, 1, "kept", _sealed("kept", payload))
    _write_pair(tmp_path, 2, "no-bucket", _sealed("no-bucket", payload))
    (tmp_path / "2.bucket").unlink()
    (tmp_path / "3.bucket").write_bytes(b"default\0lost" + payload)  # its .meta never written
    # Metadata only: reading an object's bytes would fail this test.
    monkeypatch.setattr(ssd_scan, "_check_bucket", None)
    report = ssd_scan.check_directory(str(tmp_path))
    assert report.torn == ["no-bucket"] and report.orphan_buckets == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.bucket", "1.meta"]
    # What the tier holds, counted by the check (no walk of its own at start).
    assert report.kept_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())


def test_the_check_mode_is_the_flag_then_the_environment_then_size():
    env = {ssd_scan.CHECK_ENV: "full"}
    assert ssd_scan.resolve_check(None, {}) == ("size", "the default")
    assert ssd_scan.resolve_check(None, env) == ("full", ssd_scan.CHECK_ENV)
    assert ssd_scan.resolve_check("off", env) == ("off", "--ssd-check")
    with pytest.raises(ConfigError, match=r"MOONCAKE_SPAN_SSD_CHECK: .* got 'quick'"):
        ssd_scan.resolve_check(None, {ssd_scan.CHECK_ENV: "quick"})
