"""Native-client probes for ``doctor`` and ``inspect``, in a child process: ``setup`` can
block for minutes (a dead etcd) and a bad client config can abort the process, so
:func:`probe` runs this module with a timeout, the request as JSON on its stdin and one
JSON reply on its stdout."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

_KEEP_UNTIL_EXIT: list[Any] = []


def _roundtrip(store: Any, count: int = 4, size_bytes: int = 1 << 20) -> dict[str, Any]:
    from mooncake.store import ReplicateConfig

    prefix = f"mooncake-span-doctor-{uuid.uuid4().hex[:12]}"
    keys = [f"{prefix}-{i}" for i in range(count)]
    payloads = [os.urandom(size_bytes) for _ in keys]
    # One registered arena (RDMA reads only registered memory): sources, then targets.
    arena = ctypes.create_string_buffer(b"".join(payloads), 2 * count * size_bytes)
    _KEEP_UNTIL_EXIT.append(arena)  # registered for the client's lifetime
    base = ctypes.addressof(arena)
    store.register_buffer(base, 2 * count * size_bytes)
    sources = [base + i * size_bytes for i in range(count)]
    targets = [base + (count + i) * size_bytes for i in range(count)]
    config = ReplicateConfig()
    config.replica_num = 1
    started = time.perf_counter()
    put_codes = store.batch_put_from_multi_buffers(
        keys, [[p] for p in sources], [[size_bytes]] * count, config
    )
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    get_codes = store.batch_get_into_multi_buffers(
        keys, [[p] for p in targets], [[size_bytes]] * count
    )
    get_s = time.perf_counter() - started
    exact = [ctypes.string_at(t, size_bytes) == p for t, p in zip(targets, payloads, strict=True)]
    removed = sum(store.remove(key, True) == 0 for key in keys)
    return {
        "objects": count,
        "object_bytes": size_bytes,
        "put_codes": list(put_codes),
        "get_codes": list(get_codes),
        "byte_exact": sum(exact),
        "removed": removed,
        "put_s": put_s,
        "get_s": get_s,
    }


def run(request: dict[str, Any]) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore

    s = request["settings"]
    store = MooncakeDistributedStore()
    offload = {}
    if request.get("offload_dir"):
        offload = {"enable_ssd_offload": True, "ssd_offload_path": request["offload_dir"]}
    started = time.perf_counter()
    rc = store.setup(
        local_hostname=s["local_hostname"],
        metadata_server=s["metadata_server"],
        global_segment_size=0,  # a probe contributes no memory: objects land on the nodes
        local_buffer_size=s["local_buffer_size_bytes"],
        protocol=s["protocol"],
        rdma_devices=s["device_name"],
        master_server_addr=s["master_server_address"],
        # The round trip must run in the deployment's tenant, or it proves nothing.
        tenant_id=s["tenant_id"],
        **offload,
    )
    reply: dict[str, Any] = {"setup_rc": rc, "setup_s": time.perf_counter() - started}
    if rc != 0:
        reply["error"] = f"setup returned {rc}"
        return reply
    try:
        if request["roundtrip"]:
            reply["roundtrip"] = _roundtrip(store)
        blobs: dict[str, str | None] = {}
        for key in request.get("read_keys", []):
            # get() copies through the client's own registered buffer.
            data = store.get(key) if int(store.get_size(key)) > 0 else b""
            blobs[key] = data.decode("utf-8", "replace") if data else None
        reply["blobs"] = blobs
    finally:
        # With an etcd:// (HA) master, close() -- and the native destructor,
        # which closes too -- waits 14-32 s on the leader watch. The probe holds
        # no segment, so it keeps the client alive until os._exit in main().
        if offload:
            store.unmount_local_disk_segment(0)
        if s["master_server_address"].startswith("etcd://"):
            _KEEP_UNTIL_EXIT.append(store)
        else:
            store.close()
    return reply


def main() -> int:
    request = json.loads(sys.stdin.read())
    try:
        reply = run(request)
    except Exception as exc:  # reported to the parent, which decides what it means
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    # The native client's teardown can linger (etcd watches); the answer is out.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())


def probe(
    settings: Any,
    *,
    timeout_s: float,
    native_log: str | None,
    roundtrip: bool = False,
    read_keys: list[str] | None = None,
    offload_dir: str | None = None,
) -> dict[str, Any]:
    """Run the probe child for ``settings`` (a MooncakeSettings); never blocks past timeout_s.
    The reply: ``{"setup_rc", "setup_s", "roundtrip", "blobs": {key: text or null}}``, or
    one with ``"error"``; the child's stderr (the native log) goes to ``native_log``."""
    request = {
        "settings": dataclasses.asdict(settings),
        "roundtrip": roundtrip,
        "read_keys": list(read_keys or []),
        "offload_dir": offload_dir,
    }
    env = dict(os.environ)
    if offload_dir:
        # The probe reads nothing from its SSD tier: a small staging buffer, not 1.25
        # GiB; and close() joins the offload heartbeat, 10 s apart by default.
        env.setdefault("MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES", str(16 << 20))
        env.setdefault("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1")
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    # Bounded setup: one retry instead of ~15 against a dead etcd.
    env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    try:
        log = open(native_log, "ab") if native_log else None  # noqa: SIM115 -- closed below
    except OSError as exc:
        return {"error": f"cannot write the native log {native_log}: {exc}"}
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "mooncake_span.ops.probe_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            start_new_session=True,
        )
        try:
            out, _ = child.communicate(json.dumps(request).encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, 9)
            child.communicate()
            return {"error": f"no answer within {timeout_s:.0f} s (setup blocked)"}
    finally:
        if log is not None:
            log.close()
    lines = out.decode(errors="replace").strip().splitlines()
    if child.returncode != 0 or not lines:
        return {"error": f"probe process exited with {child.returncode} and no answer"}
    try:
        return json.loads(lines[-1])
    except ValueError:
        return {"error": f"probe process answered {lines[-1][:200]!r}"}
