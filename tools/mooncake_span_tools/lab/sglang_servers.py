"""Real ``sglang.launch_server`` and ``sglang_router`` processes on this host, CPU build.

Plain servers, and prefill/decode pairs whose KV moves over the Mooncake
transfer engine (TCP on loopback here; the ``fake`` transfer backend moves no
KV and a prefill server refuses it, so it cannot stand in end to end).

Each process runs in its own session through the project's launcher
(:class:`mooncake_span.ops.launcher.LocalProcess`), so stopping it signals its
whole group by PID (sglang's scheduler and detokenizer included). Every wait
has a deadline. The CPU stand-ins reach every process of a server through
``PYTHONPATH`` (:data:`~mooncake_span_tools.testing.cpu_server.SITE_DIR`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_span.ops import launcher as L
from mooncake_span.ops.master_http import parse_prometheus
from mooncake_span_tools.testing.cpu_server import SITE_DIR

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
# A tiny model serves in 20-30 s on a quiet box; the parallel test run starts
# several at once beside other work on two cores, which took over 180 s.
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 20.0
# What uvicorn (a server) or the router prints when its port was taken.
_PORT_TAKEN = "address already in use"
_PORT_REPICKS = 3
REQUEST_TIMEOUT_S = 120.0
PREFETCH_POLICIES = ("timeout", "best_effort", "wait_complete")
STORAGE_BACKENDS = ("dynamic", "mooncake")
# What `dynamic` needs to load this project's backend (sglang's own keys).
DYNAMIC_BACKEND_KEYS = {
    "backend_name": "mooncake_span",
    "module_path": "mooncake_span.sglang_backend",
    "class_name": "MooncakeSpanStore",
    "interface_v1": 1,
}
PD_TRANSFER_BACKEND = "mooncake"
WARM_UP_TOKEN = 1
# sglang asks L3 only for a remainder of at least this many tokens (its
# prefetch_threshold default); a warm-up shorter than that never hashes a page
# for a hit query.
PREFETCH_THRESHOLD_TOKENS = 256
# Where sglang's JIT extensions are built for servers of this interpreter
# (unless the caller sets it): torch's shared default is rebuilt whenever a
# venv with another sglang path loads it, and a server that meets a rebuild
# inside a request drops that request's prefetch.
EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"
# Set in the environment of a server whose `mooncake` name this project serves.
PLUGIN_OPT_IN_ENV = "MOONCAKE_SPAN_SERVE_MOONCAKE"


class ServerError(RuntimeError):
    """A server or router did not start, answered with an error, or died."""


@dataclass(frozen=True)
class ServerOptions:
    """One server's command line; ``storage_backend=None`` serves without an L3 (recompute)."""

    model_path: Path
    layout: str = "page_first_direct"
    storage_backend: str | None = "dynamic"
    storage_config: Mapping[str, Any] = field(default_factory=dict)
    # Serve the `mooncake` name with this project's backend (the plugin opt-in).
    plugin_opt_in: bool = False
    prefetch_policy: str = "timeout"
    page_size_tokens: int = 64
    max_total_tokens: int = 4096
    hicache_ratio: float = 2.0
    write_policy: str = "write_through"
    # None, "prefill" (with bootstrap_port) or "decode" (with decode_offload to L3).
    disaggregation_mode: str | None = None
    bootstrap_port: int | None = None
    decode_offload: bool = False
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.storage_backend not in (None, *STORAGE_BACKENDS):
            raise ValueError(
                f"storage_backend must be None or one of {STORAGE_BACKENDS}, "
                f"got {self.storage_backend!r}"
            )
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"prefetch_policy must be one of {PREFETCH_POLICIES}, got {self.prefetch_policy!r}"
            )
        if self.plugin_opt_in and self.storage_backend != "mooncake":
            raise ValueError("plugin_opt_in serves the 'mooncake' backend name; set it")
        if self.disaggregation_mode not in (None, "prefill", "decode"):
            raise ValueError(
                f"disaggregation_mode must be None, 'prefill' or 'decode', "
                f"got {self.disaggregation_mode!r}"
            )
        if (self.bootstrap_port is not None) != (self.disaggregation_mode == "prefill"):
            raise ValueError("a prefill server, and only one, needs a bootstrap_port")
        if self.decode_offload and (
            self.disaggregation_mode != "decode" or self.storage_backend is None
        ):
            raise ValueError("decode_offload writes a decode server's pages to L3: set both")

    def extra_config(self) -> dict[str, Any]:
        config = dict(self.storage_config)
        if self.storage_backend == "dynamic":
            config = {**DYNAMIC_BACKEND_KEYS, **config}
        return config


def server_argv(
    options: ServerOptions, port: int, host: str = HOST, python: str = sys.executable
) -> list[str]:
    argv = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(options.model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--disable-cuda-graph",
        "--dtype",
        "float32",
        "--page-size",
        str(options.page_size_tokens),
        "--max-total-tokens",
        str(options.max_total_tokens),
        "--sleep-on-idle",
        "--enable-cache-report",
        "--hicache-ratio",
        str(options.hicache_ratio),
        "--hicache-io-backend",
        "direct",
        "--hicache-mem-layout",
        options.layout,
        "--hicache-write-policy",
        options.write_policy,
    ]
    # sglang turns the radix cache off on a decode server and then refuses
    # --enable-hierarchical-cache; decode's offload builds its host pool from
    # the other hicache flags.
    if options.disaggregation_mode != "decode":
        argv.append("--enable-hierarchical-cache")
    if options.disaggregation_mode is not None:
        argv += [
            "--disaggregation-mode",
            options.disaggregation_mode,
            "--disaggregation-transfer-backend",
            PD_TRANSFER_BACKEND,
        ]
    if options.bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(options.bootstrap_port)]
    if options.decode_offload:
        argv.append("--disaggregation-decode-enable-offload-kvcache")
    if options.storage_backend is not None:
        argv += [
            "--hicache-storage-backend",
            options.storage_backend,
            "--hicache-storage-prefetch-policy",
            options.prefetch_policy,
            "--hicache-storage-backend-extra-config",
            json.dumps(options.extra_config()),
        ]
    return argv + list(options.extra_args)


def server_env(extra: Mapping[str, str] = (), base: Mapping[str, str] | None = None) -> dict:
    """The environment of a CPU server process: stand-ins on the path, TCP on loopback."""
    env = dict(os.environ if base is None else base)
    path = [str(SITE_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(path),
            "SGLANG_USE_CPU_ENGINE": "1",
            "MC_TCP_BIND_ADDRESS": HOST,
            "MOONCAKE_PROTOCOL": "tcp",
            "SGLANG_HOST_IP": HOST,
            # One core's worth of threads per process keeps several servers from
            # thrashing a small box.
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            EXTENSIONS_ENV: env.get(EXTENSIONS_ENV) or extensions_dir(),
        }
    )
    env.update(extra)
    return env


def extensions_dir(prefix: str = sys.prefix) -> str:
    """The JIT extension folder of the servers this interpreter starts: inside its venv."""
    return str(Path(prefix) / "torch-extensions")


@dataclass(frozen=True)
class Completion:
    """One greedy generation and what the server says about its prefix cache."""

    output_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    storage_tokens: int
    e2e_s: float
    meta_info: Mapping[str, Any]
    # Per answer token, its top candidates as (token id, logprob), best first;
    # empty unless the request asked for them (``top_logprobs``).
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


def _post_json(url: str, body: Mapping[str, Any], timeout_s: float) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise ServerError(f"POST {url} answered {exc.code}: {detail}") from exc


def generate_body(
    input_ids: Sequence[int], max_new_tokens: int, top_logprobs: int = 0
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    if top_logprobs:
        # Only the answer's logprobs: starting at the last prompt token keeps the
        # prompt's own (which a restored prefix never computes) out of it.
        body.update(
            return_logprob=True,
            top_logprobs_num=top_logprobs,
            logprob_start_len=max(len(body["input_ids"]) - 1, 0),
        )
    return body


def parse_completion(answer: Mapping[str, Any], e2e_s: float) -> Completion:
    meta = answer.get("meta_info", {})
    details = meta.get("cached_tokens_details") or {}
    top = tuple(
        tuple((int(entry[1]), float(entry[0])) for entry in per_token)
        for per_token in meta.get("output_top_logprobs") or ()
    )
    return Completion(
        output_ids=tuple(answer["output_ids"]),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        storage_tokens=int(details.get("storage", 0) or 0),
        e2e_s=e2e_s,
        meta_info=meta,
        top_logprobs=top,
    )


def _call_here(fn: Callable[[], Any]) -> Any:
    return fn()


@dataclass(frozen=True)
class Place:
    """Where a server runs and how this process reaches it; the default is loopback here."""

    address: str = HOST
    wrap_argv: Callable[[list[str]], list[str]] = list
    env: Mapping[str, str] = field(default_factory=dict)
    call: Callable[[Callable[[], Any]], Any] = _call_here


def namespace_place(topology: Any, host: str) -> Place:
    """A host of a :class:`~mooncake_span_tools.lab.topology.NetnsTopology`: its address, its
    Mooncake environment, and every HTTP request sent from inside its namespace."""
    address = topology.address(host)
    return Place(
        address=address,
        wrap_argv=lambda argv: topology.exec_argv(host, argv),
        env={**topology.host_env(host), "SGLANG_HOST_IP": address},
        call=lambda fn: topology.call_in(host, fn, REQUEST_TIMEOUT_S + 10.0),
    )


class _Served:
    """A process with an HTTP port, started and stopped by PID group."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_dir: Path,
        port: int,
        place: Place = Place(),
        repick: Callable[[], tuple[int, list[str]]] | None = None,
    ):
        self.name = name
        self.port = port
        self.place = place
        # A fresh port and the argv for it, where the port was picked here rather
        # than given: a picked port can still be taken before the process binds it.
        self._repick = repick
        log_dir.mkdir(parents=True, exist_ok=True)
        self.process = L.LocalProcess(name, place.wrap_argv(argv), log_dir / f"{name}.log", env)

    @property
    def url(self) -> str:
        return f"http://{self.place.address}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _ready(self) -> bool:
        # /model_info, not /health: a port picked free can be taken by another
        # process before the server binds it, and a Mooncake master answers /health.
        # Then /health, which answers 503 until sglang's own start-up request is done:
        # /model_info answers before it.
        info_url, health_url = f"{self.url}/model_info", f"{self.url}/health"
        info = self.place.call(lambda: L.http_get(info_url, timeout_s=5.0))
        if info is None or info[0] != 200 or '"model_path"' not in info[1]:
            return False
        health = self.place.call(lambda: L.http_get(health_url, timeout_s=5.0))
        return health is not None and health[0] == 200

    def start(self, timeout_s: float = START_TIMEOUT_S) -> _Served:
        self.process.start()
        return self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> _Served:
        """Wait until the process serves; a process that died or missed the deadline raises."""
        deadline = time.monotonic() + timeout_s
        repicks_left = _PORT_REPICKS
        while not self._ready():
            if self._repick is not None and repicks_left and _PORT_TAKEN in self.log_text().lower():
                repicks_left -= 1
                self._restart_on_fresh_port()
                continue
            if not self.process.running():
                raise ServerError(
                    f"{self.name} exited with {self.process.exit_code()} before it served:\n"
                    f"{self.process.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"{self.name} did not serve within {timeout_s:.0f}s:\n{self.process.log_tail()}"
                )
            time.sleep(0.5)
        logger.info("%s serving at %s (pid %s)", self.name, self.url, self.pid)
        return self

    def _restart_on_fresh_port(self) -> None:
        assert self._repick is not None
        taken = self.port
        self.stop()
        self.port, argv = self._repick()
        logger.warning(
            "%s: port %d was taken before it bound; restarting on %d", self.name, taken, self.port
        )
        self.process.argv = self.place.wrap_argv(argv)
        self.process.start()

    def running(self) -> bool:
        return self.process.running()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        L.terminate([self.process], signal.SIGTERM, grace_s)

    def kill(self) -> None:
        L.terminate([self.process], signal.SIGKILL, 5.0)

    def log_text(self) -> str:
        return self.process.output_text()

    def __enter__(self) -> _Served:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class SglangServer(_Served):
    """One ``sglang.launch_server`` process."""

    def __init__(
        self,
        name: str,
        options: ServerOptions,
        log_dir: Path,
        port: int | None = None,
        env: Mapping[str, str] = (),
        place: Place = Place(),
    ) -> None:
        repick = None
        if port is None:
            port = L.pick_free_ports(HOST, 1)[0]

            def repick() -> tuple[int, list[str]]:
                fresh = L.pick_free_ports(HOST, 1)[0]
                return fresh, server_argv(options, fresh, place.address)

        # Said either way: an opt-in left in the caller's environment must not
        # turn a MooncakeStore arm into this backend.
        extra_env = {PLUGIN_OPT_IN_ENV: "1" if options.plugin_opt_in else "0", **options.env}
        extra_env.update(place.env)
        extra_env.update(env)
        argv = server_argv(options, port, place.address)
        super().__init__(name, argv, server_env(extra_env), log_dir, port, place, repick)
        self.options = options

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int = 8,
        timeout_s: float = REQUEST_TIMEOUT_S,
        url: str | None = None,
        top_logprobs: int = 0,
    ) -> Completion:
        target = f"{url or self.url}/generate"
        body = generate_body(input_ids, max_new_tokens, top_logprobs)
        started = time.perf_counter()
        answer = self.place.call(lambda: _post_json(target, body, timeout_s))
        return parse_completion(answer, time.perf_counter() - started)

    def warm_up(self) -> None:
        """Answer one prompt long enough to be prefetched, then drop the caches it filled.

        sglang loads some of what a restore needs at its first use, its page-hash
        extension above all (6 s with the extension built, more to build it).
        Left to the first measured request, that load sits inside the prefetch a
        hit query starts, and the default ``timeout`` policy (1 s plus 0.25 s per
        1,024 tokens) drops the prefetch. This backend loads the hash while the
        server starts; sglang's ``MooncakeStore`` does not, so every server is
        warmed the same way: a prompt whose remainder reaches a hit query, and
        whose pages are then backed up. It is one token repeated, pages nobody
        else sends; its keys in L3 are the same for every server.
        """
        if self.options.disaggregation_mode is not None:
            return  # served only through a router, with its peer
        page = self.options.page_size_tokens
        self.generate([WARM_UP_TOKEN] * (max(PREFETCH_THRESHOLD_TOKENS, page) + page + 1), 1)
        self.flush_cache()

    def metrics(self) -> dict[str, float]:
        """The server's ``/metrics`` (with ``--enable-metrics``), summed per family and labels
        that matter here: ``name`` or ``name{label="value"}`` for each label of a sample."""
        url = f"{self.url}/metrics"
        answer = self.place.call(lambda: L.http_get(url, timeout_s=10.0))
        if answer is None or answer[0] != 200:
            raise ServerError(f"{self.name}: GET /metrics answered {answer}")
        return sum_samples(parse_prometheus(answer[1]))

    def flush_cache(self, timeout_s: float = 30.0) -> None:
        """Drop the device and host caches, so the next request can only hit L3.

        sglang refuses while a request is queued or running (the last answer's
        bookkeeping can still be in flight), so this retries until ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        url = f"{self.url}/flush_cache"

        def flush() -> L.HttpAnswer | None:
            return L.http_get(url, timeout_s=timeout_s)

        while True:
            answer = self.place.call(flush)
            if answer is not None and answer[0] == 200:
                return
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name}: /flush_cache answered {answer}")
            time.sleep(0.2)


def sum_samples(samples: Sequence[tuple[str, Mapping[str, str], float]]) -> dict[str, float]:
    """Samples summed by family name, and by family name with each single label."""
    sums: dict[str, float] = {}
    for name, labels, value in samples:
        for key in (name, *(f'{name}{{{k}="{v}"}}' for k, v in labels.items())):
            sums[key] = sums.get(key, 0.0) + value
    return sums


def start_together(servers: Sequence[_Served]) -> None:
    """Start every process at once (a server takes ~30 s), wait for all, warm servers up.

    If one fails, every one of them is stopped before the error propagates.
    """
    for server in servers:
        server.process.start()
    try:
        for server in servers:
            server.wait_ready()
        for server in servers:
            if isinstance(server, SglangServer):
                server.warm_up()
    except BaseException:
        stop_together(servers)
        raise


def stop_together(served: Sequence[_Served], grace_s: float = STOP_GRACE_S) -> None:
    """Stop every process at once, by PID group: SIGTERM, up to ``grace_s`` for all of
    them together, then SIGKILL for any left. Servers stopped one by one would each
    spend their own grace."""
    L.terminate([s.process for s in served], signal.SIGTERM, grace_s)


def settled_count(count: Callable[[], int], timeout_s: float = 30.0, settle_s: float = 1.0) -> int:
    """``count()`` once it has not changed for ``settle_s``: write-through backups land
    asynchronously, so a master's key count is a baseline only when it is quiet."""
    deadline = time.monotonic() + timeout_s
    last, since = count(), time.monotonic()
    while time.monotonic() - since < settle_s:
        if time.monotonic() > deadline:
            raise ServerError(f"the count kept changing for {timeout_s:.0f}s")
        time.sleep(0.2)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
    return last


def router_argv(
    prefill_urls: Sequence[tuple[str, int]],
    decode_urls: Sequence[str],
    port: int,
    prometheus_port: int,
    python: str = sys.executable,
) -> list[str]:
    argv = [python, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, bootstrap_port in prefill_urls:
        argv += ["--prefill", url, str(bootstrap_port)]
    for url in decode_urls:
        argv += ["--decode", url]
    # The router always serves Prometheus metrics, by default on 0.0.0.0:29000:
    # a second router on the host (or another test's) would panic on that port.
    metrics = ["--prometheus-host", HOST, "--prometheus-port", str(prometheus_port)]
    return argv + ["--host", HOST, "--port", str(port), "--policy", "round_robin", *metrics]


class Router(_Served):
    """``sglang_router`` in prefill/decode mode in front of given servers."""

    def __init__(
        self,
        name: str,
        prefill: Sequence[tuple[SglangServer, int]],
        decode: Sequence[SglangServer],
        log_dir: Path,
    ) -> None:
        def pick() -> tuple[int, list[str]]:
            port, prometheus_port = L.pick_free_ports(HOST, 2)
            urls = [(s.url, b) for s, b in prefill], [s.url for s in decode]
            return port, router_argv(*urls, port, prometheus_port)

        port, argv = pick()
        super().__init__(name, argv, server_env(), log_dir, port, repick=pick)

    def _ready(self) -> bool:
        # The router answers before it has workers; readiness is a generation that
        # goes through, which generate_until_served waits for.
        answer = L.http_get(f"{self.url}/health", timeout_s=5.0)
        return answer is not None

    def generate_until_served(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        timeout_s: float = 90.0,
        top_logprobs: int = 0,
    ) -> Completion:
        """The first generation through the router; it answers 503 until workers register."""
        deadline = time.monotonic() + timeout_s
        while True:
            started = time.perf_counter()
            try:
                answer = _post_json(
                    f"{self.url}/generate",
                    generate_body(input_ids, max_new_tokens, top_logprobs),
                    REQUEST_TIMEOUT_S,
                )
                return parse_completion(answer, time.perf_counter() - started)
            except ServerError as exc:
                if " 503" not in str(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(1.0)
