"""``mooncake-span doctor``: check a node's Mooncake setup, one line per check. The
native client runs only in the ``probe_worker`` child, so the command ends within
``DEADLINE_S`` even with a dead master or etcd (docs/operating.md, "mooncake-span doctor")."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from mooncake_span.config import load_span_options
from mooncake_span.errors import MooncakeSpanError, code_name
from mooncake_span.mooncake_settings import RankInfo
from mooncake_span.ops import master_http
from mooncake_span.ops.cli_common import (
    add_connection_args,
    admin_url,
    resolve_native_log,
    resolve_settings,
)
from mooncake_span.ops.doctor_host import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    Check,
    Context,
    check_device,
    check_memlock,
    check_memory,
)
from mooncake_span.ops.doctor_ssd import check_ssd, master_check, ssd_requested
from mooncake_span.ops.probe_worker import probe
from mooncake_span.store.native import (
    CHECKSUM_ENV,
    MOONCAKE_DISTRIBUTIONS,
    checksum_setting,
    installed_mooncake,
    mooncake_import_failure,
    mooncake_install_hint,
)
from mooncake_span.units import parse_size_bytes

DEADLINE_S = 18.0
_NET_TIMEOUT_S = 2.0
# A Mooncake build that takes longer than this to import is reported as failing.
_IMPORT_TIMEOUT_S = 10.0
_SYN_RETRIES_PATH = "/proc/sys/net/ipv4/tcp_syn_retries"


def _tcp(endpoint: str) -> str | None:
    """None when ``HOST:PORT`` accepts a connection, else why not."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_NET_TIMEOUT_S):
            return None
    except (OSError, ValueError) as exc:
        return str(exc) or type(exc).__name__


def _http_status(url: str) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=_NET_TIMEOUT_S) as resp:
            return resp.status, resp.read(400).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(400).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, str(getattr(exc, "reason", exc))


def check_master(ctx: Context) -> list[Check]:
    address = ctx.settings.master_server_address
    if address.startswith("etcd://"):
        return [Check("master", SKIP, "HA masters behind etcd: see the etcd check"), *_admin(ctx)]
    why = _tcp(address)
    if why is not None:
        ctx.failed.add("master")
        fix = "start mooncake_master there or correct master_server_address (HOST:RPC_PORT)"
        return [Check("master", FAIL, f"master {address} does not accept connections: {why}", fix)]
    return [Check("master", PASS, f"master {address} accepts connections"), *_admin(ctx)]


def _admin(ctx: Context) -> list[Check]:
    if ctx.admin_url is None:
        return []
    try:
        health = master_http.health(ctx.admin_url, _NET_TIMEOUT_S)
    except master_http.AdminError as exc:
        detail = f"admin server not reachable ({exc}); the master's version and role are unknown"
        fix = "pass --admin-url http://HOST:METRICS_PORT (mooncake_master --metrics_port)"
        return [Check("master admin", WARN, detail, fix)]
    status = PASS if health.get("status") == "ok" and health.get("service_ready", True) else WARN
    detail = (
        f"{ctx.admin_url}/health: status={health.get('status')} role={health.get('role')} "
        f"state={health.get('ha_state')} (the master does not publish its version over HTTP)"
    )
    fix = None if status == PASS else "the master is not serving yet; wait or check its log"
    client_version = ", ".join(b.describe() for b in installed_mooncake()) or None
    data = {"health": health, "client_version": client_version}
    return [Check("master admin", status, detail, fix, data)]


def _import_failure(ctx: Context) -> ImportError | None:
    """Whether ``mooncake.store`` imports, tried in a child: the native library runs
    only there (a wrong build can abort the process that loads it)."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", "import mooncake.store"],
            capture_output=True,
            text=True,
            timeout=max(1.0, min(_IMPORT_TIMEOUT_S, ctx.remaining_s())),
        )
    except subprocess.TimeoutExpired:
        return ImportError(f"importing mooncake.store took over {_IMPORT_TIMEOUT_S:.0f} s")
    if result.returncode == 0:
        return None
    lines = result.stderr.strip().splitlines() or [f"exit status {result.returncode}"]
    return ImportError(lines[-1])


def check_mooncake_build(ctx: Context) -> list[Check]:
    """Which Mooncake distribution provides ``mooncake``: exactly one, one this
    package knows (CPU, CUDA 12, CUDA 13, EFA), and it imports."""
    builds, name = installed_mooncake(), "mooncake build"
    data = {"builds": [dataclasses.asdict(b) for b in builds]}
    if not builds:
        ctx.failed.add("mooncake")
        return [Check(name, FAIL, "no distribution provides `mooncake`", mooncake_install_hint())]
    said = ", ".join(b.describe() for b in builds)
    failure = _import_failure(ctx)
    if failure is not None:
        ctx.failed.add("mooncake")
        return [Check(name, FAIL, mooncake_import_failure(failure, builds), None, data)]
    if len(builds) > 1:
        status, fix = WARN, "uninstall all of them and install the one for this host"
        detail = (
            f"several builds provide `mooncake`: {said}; they install the same files over "
            "each other"
        )
    elif builds[0].host_kind is None:
        status, fix = WARN, mooncake_install_hint()
        detail = f"{said}: the backend is tested on {', '.join(MOONCAKE_DISTRIBUTIONS)}"
    else:
        status, detail, fix = PASS, said, None
    return [Check(name, status, detail, fix, data)]


def check_metadata(ctx: Context) -> list[Check]:
    md = ctx.settings.metadata_server
    if md == "P2PHANDSHAKE":
        return [Check("metadata", PASS, "P2PHANDSHAKE: peers exchange metadata directly")]
    if not md.startswith(("http://", "https://")):
        return [Check("metadata", SKIP, f"{md} is etcd: see the etcd check")]
    status, body = _http_status(f"{md}?key=mooncake-span-doctor-probe")
    # Mooncake's HTTP metadata server answers an unknown key with 404 "metadata not found".
    if status == 200 or (status == 404 and "metadata not found" in body):
        return [Check("metadata", PASS, f"{md} answers as a Mooncake metadata server")]
    ctx.failed.add("metadata")
    if status is None:
        why = f"{md} is unreachable: {body}"
    else:
        why = f"{md} answered HTTP {status} {body.strip()[:80]!r}, not a Mooncake metadata server"
    fix = (
        "use the URL `mooncake-span cluster up` prints (http://HOST:PORT/metadata of the "
        "master's --http_metadata_server_port or mooncake_http_metadata_server)"
    )
    return [Check("metadata", FAIL, why, fix)]


def check_etcd(ctx: Context) -> list[Check]:
    endpoints = ctx.settings.etcd_endpoints()
    # run_checks loaded these options already: the checks run only if that worked.
    options = load_span_options(ctx.extra)
    if options.layout_guard == "etcd" and options.layout_guard_etcd:
        endpoints.append(options.layout_guard_etcd)
    if not endpoints:
        return [Check("etcd", SKIP, "not used (no etcd:// master, metadata or layout guard)")]
    checks = []
    for endpoint in dict.fromkeys(endpoints):
        status, body = _http_status(f"http://{endpoint}/version")
        if status == 200 and "etcdserver" in body:
            version = json.loads(body).get("etcdserver")
            checks.append(Check("etcd", PASS, f"etcd {endpoint} answers (etcd {version})"))
            continue
        ctx.failed.add("etcd")
        why = body if status is None else f"HTTP {status}"
        fix = "start etcd or fix the endpoint; with a dead etcd Mooncake's setup blocks for minutes"
        checks.append(Check("etcd", FAIL, f"etcd {endpoint} does not answer: {why}", fix))
    return checks


def _is_local_address(address: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def _resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def check_bind(ctx: Context) -> list[Check]:
    s = ctx.settings
    bind = os.environ.get("MC_TCP_BIND_ADDRESS")
    hostname_ip = _resolve(s.local_hostname)
    master_host = s.master_server_address.removeprefix("etcd://").split(";")[0].rpartition(":")[0]
    master_ip = _resolve(master_host)
    data = {"bind": bind, "local_hostname": s.local_hostname, "resolved": hostname_ip}
    if not bind:
        status = WARN
        detail = (
            f"MC_TCP_BIND_ADDRESS is not set: the transfer engine advertises the first non-lo "
            f"interface, not local_hostname {s.local_hostname!r}"
        )
        fix = (
            f"export MC_TCP_BIND_ADDRESS={hostname_ip or 'THIS_HOST_IP'} (the address peers "
            "reach this host on)"
        )
    elif not _is_local_address(bind):
        status, detail = FAIL, f"MC_TCP_BIND_ADDRESS={bind} is not an address of this host"
        fix = "set it to one of this host's addresses (ip -brief addr)"
    elif hostname_ip != bind:
        status = FAIL
        detail = (
            f"local_hostname {s.local_hostname!r} resolves to {hostname_ip} but "
            f"MC_TCP_BIND_ADDRESS is {bind}: peers and the master would see two addresses"
        )
        fix = (
            f"set local_hostname (or MOONCAKE_LOCAL_HOSTNAME) to {bind}, or "
            f"MC_TCP_BIND_ADDRESS to {hostname_ip or 'the local_hostname address'}"
        )
    # Both addresses come from gethostbyname here: dotted IPv4, never a ValueError.
    elif (
        ipaddress.ip_address(bind).is_loopback
        and master_ip is not None
        and not ipaddress.ip_address(master_ip).is_loopback
    ):
        status = FAIL
        detail = (
            f"this host binds loopback {bind} but the master is remote ({master_host}): "
            "storage nodes elsewhere cannot reach it"
        )
        fix = "set MC_TCP_BIND_ADDRESS and local_hostname to this host's LAN address"
    else:
        status, fix = PASS, None
        detail = f"local_hostname and MC_TCP_BIND_ADDRESS agree on {bind}"
    return [Check("bind address", status, detail, fix, data)]


def check_syn_retries(ctx: Context) -> list[Check]:
    try:
        with open(_SYN_RETRIES_PATH, encoding="ascii") as fh:
            value = int(fh.read().strip())
    except (OSError, ValueError) as exc:
        return [Check("tcp_syn_retries", SKIP, f"cannot read {_SYN_RETRIES_PATH}: {exc}")]
    if value <= 2:
        return [Check("tcp_syn_retries", PASS, f"net.ipv4.tcp_syn_retries={value}")]
    detail = (
        f"net.ipv4.tcp_syn_retries={value}: a connect to a partitioned node waits for the "
        "kernel's retries, and a transfer then blocks for Mooncake's 60 s"
    )
    fix = "sysctl -w net.ipv4.tcp_syn_retries=1 (a connect gives up after ~3 s)"
    return [Check("tcp_syn_retries", WARN, detail, fix, {"value": value})]


def check_checksums(ctx: Context) -> list[Check]:
    try:
        verify, why = checksum_setting(load_span_options(ctx.extra), os.environ)
    except MooncakeSpanError as exc:
        return [Check("checksums", FAIL, str(exc), f"drop {CHECKSUM_ENV} or the option")]
    detail = (
        f"restores verified against Mooncake's CRC-64 per object ({why}); costs a CPU pass per "
        "byte on put and get"
        if verify
        else f"restores not verified ({why}): a corrupted stored object is restored as hits"
    )
    return [Check("checksums", PASS, detail, data={"verify_checksums": verify, "source": why})]


def _roundtrip_check(reply: dict[str, Any], ctx: Context) -> Check:
    where = f" (native log: {ctx.native_log})" if ctx.native_log else ""
    rt = reply.get("roundtrip")
    if "error" in reply or rt is None:
        return Check(
            "round trip",
            FAIL,
            f"the store client could not set up: {reply.get('error', 'no result')}{where}",
            "fix the FAIL lines above; check local_hostname, metadata_server and the protocol",
        )
    size, count = rt["object_bytes"], rt["objects"]
    put_ok = sum(code == 0 for code in rt["put_codes"])
    get_ok = sum(code == size for code in rt["get_codes"])
    mb = size * count / 1e6
    detail = (
        f"{count} x {size} bytes: setup {reply['setup_s']:.2f} s, put {rt['put_s'] * 1e3:.1f} ms "
        f"({mb / max(rt['put_s'], 1e-9):.0f} MB/s), get {rt['get_s'] * 1e3:.1f} ms "
        f"({mb / max(rt['get_s'], 1e-9):.0f} MB/s), {rt['byte_exact']}/{count} byte-exact, "
        f"{rt['removed']}/{count} removed"
    )
    data = {**rt, "setup_s": reply["setup_s"]}
    if put_ok == get_ok == rt["byte_exact"] == count:
        return Check("round trip", PASS, detail, None, data)
    failed = sorted({code_name(c) for c in rt["put_codes"] if c != 0})
    fix = "check the storage nodes (mooncake-span inspect shows segments and usage)"
    if "NO_AVAILABLE_HANDLE" in failed:
        fix = "no space: start storage nodes (global_segment_size > 0) or free segment memory"
    return Check("round trip", FAIL, f"{detail}; put failures {failed}{where}", fix, data)


def _guard_check(reply: dict[str, Any], key: str | None) -> Check:
    if key is None:
        return Check("layout guard", SKIP, "pass --model (and --tag) to read a namespace's record")
    blobs = reply.get("blobs") or {}
    if key not in blobs:
        return Check("layout guard", SKIP, f"{key}: not read (no store client)")
    text = blobs[key]
    if text is None:
        return Check("layout guard", PASS, f"{key}: no record yet (the first node publishes it)")
    try:
        record = json.loads(text)
    except ValueError:
        fix = "remove the key; nodes refuse to start against a record they cannot read"
        return Check("layout guard", FAIL, f"{key} holds no JSON: {text[:60]!r}", fix)
    summary = (
        f"host page {record.get('host_page_tokens')} tokens, storage page "
        f"{record.get('storage_page_tokens')}, layout {record.get('layout')}, "
        f"dtype {record.get('kv_dtype')}, pools {sorted(record.get('pools', {}))}"
    )
    return Check("layout guard", PASS, f"{key}: {summary}", None, {"record": record})


def check_store(ctx: Context) -> list[Check]:
    """A real round trip, and the layout-guard record, through one probe child."""
    blocked = sorted(ctx.failed & {"mooncake", "master", "metadata", "etcd"})
    if blocked:
        why = f"skipped: {', '.join(blocked)} failed above"
        return [
            Check("round trip", FAIL, why, "fix the FAIL lines above first"),
            Check("layout guard", SKIP, why),
        ]
    budget = ctx.remaining_s() - 0.5
    if budget < 3:
        return [Check("round trip", FAIL, "no time left for a round trip", "rerun")]
    with tempfile.TemporaryDirectory(prefix="mooncake-span-doctor-ssd-") as scratch:
        reply = probe(
            ctx.settings,
            timeout_s=budget,
            native_log=ctx.native_log,
            roundtrip=True,
            read_keys=[ctx.guard_key] if ctx.guard_key else [],
            # With an SSD tier asked for, the probe sets up as one: the master must accept it.
            offload_dir=scratch if ssd_requested(ctx) else None,
        )
    checks = [_roundtrip_check(reply, ctx), _guard_check(reply, ctx.guard_key)]
    return checks + ([master_check(reply)] if ssd_requested(ctx) else [])


def _local_rank_devices(args: argparse.Namespace, ctx: Context) -> dict[int, str]:
    """tp_rank -> NIC for every tp rank on this host (the device_name map resolved per rank)."""
    if ctx.settings.protocol != "rdma":
        return {}
    devices = {}
    for rank in range(min(ctx.ranks.tp_size, ctx.local_ranks)):
        ranks = dataclasses.replace(ctx.ranks, tp_rank=rank)
        devices[rank] = resolve_settings(args, ranks=ranks)[0].device_name
    return devices


def run_checks(args: argparse.Namespace) -> tuple[list[Check], Context]:
    ctx = Context(deadline=time.monotonic() + DEADLINE_S, ssd_dir=args.ssd_dir)
    ctx.native_log = resolve_native_log(args.native_log, "doctor")
    try:
        ctx.ranks = RankInfo(tp_rank=args.tp_rank, tp_size=args.tp_size, pp_size=args.pp_size)
        ctx.local_ranks = args.local_ranks or ctx.ranks.ranks_per_server
        ctx.host_pool_bytes = parse_size_bytes(args.host_pool_bytes)
        if args.segment_bytes is not None:
            ctx.ssd_segment_bytes = parse_size_bytes(args.segment_bytes)
        ctx.settings, ctx.extra = resolve_settings(args, ranks=ctx.ranks)
        ctx.staging_bytes = load_span_options(ctx.extra).staging_buffer_size_bytes
        ctx.rank_devices = _local_rank_devices(args, ctx)
    except (MooncakeSpanError, ValueError) as exc:
        return [Check("config", FAIL, str(exc), "fix the configuration source named above")], ctx
    s = ctx.settings
    ctx.admin_url = admin_url(args, s, ctx.extra)
    if args.model is not None:
        # Imported here: the store's modules load numpy, which the CLI does not need to start.
        from mooncake_span.store.layout_guard import namespace_key

        ctx.guard_key = namespace_key(args.model, args.tag or ctx.extra.get("extra_backend_tag"))
    checks = [
        Check(
            "config",
            PASS,
            f"master {s.master_server_address}, metadata {s.metadata_server}, protocol "
            f"{s.protocol}, local_hostname {s.local_hostname}, tenant {s.tenant_id}, segment "
            f"{s.global_segment_size_bytes} bytes per rank (tp_rank {ctx.ranks.tp_rank} of "
            f"tp {ctx.ranks.tp_size} x pp {ctx.ranks.pp_size}), admin {ctx.admin_url} "
            f"(master_metrics_port {s.master_metrics_port or 'not set, 9003 tried'}) "
            f"(from {s.source})",
            data={"settings": dataclasses.asdict(s)},
        )
    ]
    for check in (
        check_mooncake_build,
        check_master,
        check_metadata,
        check_etcd,
        check_bind,
        check_device,
        check_memlock,
        check_syn_retries,
        check_memory,
        check_checksums,
        check_ssd,
        check_store,
    ):
        checks += check(ctx)
    return checks, ctx


def format_text(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in (WARN, FAIL):
            lines.append(f"{'':4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def run_doctor_command(args: argparse.Namespace) -> int:
    started = time.monotonic()
    checks, ctx = run_checks(args)
    failed = sum(c.status == FAIL for c in checks)
    if args.json:
        doc = {
            "ok": failed == 0,
            "elapsed_s": round(time.monotonic() - started, 3),
            "native_log": ctx.native_log,
            "checks": [dataclasses.asdict(c) for c in checks],
        }
        print(json.dumps(doc, indent=1, default=str), flush=True)
    else:
        print(format_text(checks), flush=True)
        verdict = "OK" if failed == 0 else f"{failed} check(s) FAILED"
        print(f"doctor: {verdict} in {time.monotonic() - started:.1f} s", flush=True)
        if ctx.native_log and os.path.exists(ctx.native_log):
            print(f"native log: {ctx.native_log}", file=sys.stderr, flush=True)
    return 0 if failed == 0 else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check this node's Mooncake setup (PASS / WARN / FAIL with the fix)",
        description=(
            "Check config, master, metadata server, etcd, bind address, RDMA device and memlock, "
            "tcp_syn_retries, memory, the SSD tier when one is asked for, a real put/get/remove "
            "round trip and the namespace's layout-guard record. Reads the same config sources "
            f"as the backend. Exits 1 if any check FAILs; finishes within about {DEADLINE_S:.0f} s."
        ),
    )
    add_connection_args(parser)
    parser.add_argument("--model", help="model name whose layout-guard record to read")
    parser.add_argument("--tag", help="extra_backend_tag of that namespace")
    parser.add_argument(
        "--ssd-dir",
        metavar="DIR",
        help="check an SSD tier on DIR (a storage node's --ssd-dir) and that the master "
        "accepts one; a rank's enable_ssd_offload is checked without it",
    )
    parser.add_argument(
        "--segment-bytes",
        metavar="SIZE",
        help="with --ssd-dir: the storage node's --segment-bytes, the largest object its SSD "
        "tier must hold (default: the config's global_segment_size)",
    )
    ranks = parser.add_argument_group(
        "deployment", "the sglang rank to check, as its HiCacheStorageConfig would name it"
    )
    ranks.add_argument("--tp-rank", type=int, default=0, help="tp_rank (picks the NIC of a map)")
    ranks.add_argument("--tp-size", type=int, default=1, help="the server's tp_size")
    ranks.add_argument("--pp-size", type=int, default=1, help="the server's pp_size")
    ranks.add_argument(
        "--local-ranks",
        type=int,
        default=0,
        help="ranks of the server on this host (default tp_size x pp_size)",
    )
    ranks.add_argument(
        "--host-pool-bytes",
        default="0",
        help="host KV pool bytes per rank (--hicache-size), registered with the segment",
    )
    parser.set_defaults(func=run_doctor_command)
