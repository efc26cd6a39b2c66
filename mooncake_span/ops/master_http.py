"""The Mooncake master's HTTP admin API (its ``--metrics_port`` server; the routes read:
docs/operating.md, "mooncake-span inspect"). Every request has a timeout; keys stream
line by line, so 100k keys never sit in memory as one string."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class AdminError(RuntimeError):
    """The admin server did not answer, or answered something unexpected."""


def get_text(url: str, timeout_s: float) -> str:
    """The response's non-empty lines, stripped (JSON and Prometheus text read the same)."""
    return "\n".join(iter_lines(url, timeout_s))


def iter_lines(url: str, timeout_s: float) -> Iterator[str]:
    """Non-empty lines of a response, streamed."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if line:
                    yield line
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise AdminError(f"GET {url}: {exc}") from exc


def health(base_url: str, timeout_s: float) -> dict[str, Any]:
    text = get_text(base_url + "/health", timeout_s)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise AdminError(f"{base_url}/health answered {text[:120]!r}") from exc


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` per sample line of a Prometheus text page."""
    samples = []
    for line in text.splitlines():
        # Blank and "#" lines cannot match: a sample starts with a metric name.
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        samples.append((match.group(1), labels, value))
    return samples


def master_metrics(base_url: str, timeout_s: float) -> list[tuple[str, dict[str, str], float]]:
    return parse_prometheus(get_text(base_url + "/metrics", timeout_s))


def object_size_bytes(base_url: str, key: str, timeout_s: float) -> int | None:
    """Size of one object from its first replica descriptor; None if unknown."""
    url = f"{base_url}/query_key?key={urllib.parse.quote(key, safe='')}"
    try:
        doc = json.loads(get_text(url, timeout_s))
    except (AdminError, ValueError):
        return None
    replicas = doc.get("data") or [] if isinstance(doc, dict) else []
    sizes = (r.get("size_") for r in replicas if isinstance(r, dict))
    return next((size for size in sizes if isinstance(size, int)), None)
