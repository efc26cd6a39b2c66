"""``mooncake-span validate``'s HTTP half: sglang's own endpoints of one running server.

A server out of reach or a malformed answer is a :class:`ServerUnreachable` naming the URL.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from mooncake_span.ops.master_http import parse_prometheus

REQUEST_TIMEOUT_S = 600.0
INFO_TIMEOUT_S = 30.0
FLUSH_RETRY_S = 0.2


class ServerUnreachable(RuntimeError):
    """A server did not answer, or answered something other than sglang's API."""


class ServerRefused(ServerUnreachable):
    """A server answered an HTTP error (the status and its text are in the message)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class SglangHttp:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            self.url = "http://" + self.url

    def _request(
        self, path: str, body: Mapping[str, Any] | None, timeout_s: float, method: str = "GET"
    ) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method="POST" if data is not None else method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310
                return answer.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace").strip()[:500]
            raise ServerRefused(
                f"{self.url}{path} answered HTTP {exc.code}: {detail}", exc.code
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerUnreachable(f"{self.url} unreachable ({path}): {reason}") from None

    def _json(
        self, path: str, body: Mapping[str, Any] | None = None, timeout_s: float = INFO_TIMEOUT_S
    ) -> Any:
        raw = self._request(path, body, timeout_s)
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerUnreachable(
                f"{self.url}{path} did not answer JSON (is this an sglang server?): {raw[:200]!r}"
            ) from None

    def _info(self, name: str) -> Any:
        """``/{name}``, or ``/get_{name}`` where an older build has only that."""
        try:
            return self._json(f"/{name}")
        except ServerRefused as exc:
            if exc.status != 404:
                raise
            return self._json(f"/get_{name}")

    def server_info(self) -> dict[str, Any]:
        info = self._info("server_info")
        if not isinstance(info, dict) or "page_size" not in info:
            raise ServerUnreachable(f"{self.url}/server_info is not sglang's server info")
        return info

    def model_info(self) -> dict[str, Any]:
        info = self._info("model_info")
        return info if isinstance(info, dict) else {}

    def tokenize_chat(self, content: str) -> list[int]:
        """Token ids of one user message through the server's chat template."""
        answer = self._json("/tokenize", {"messages": [{"role": "user", "content": content}]})
        return [int(t) for t in answer["tokens"]]

    def tokenize_text(self, text: str, special_tokens: bool) -> list[int]:
        answer = self._json("/tokenize", {"prompt": text, "add_special_tokens": special_tokens})
        return [int(t) for t in answer["tokens"]]

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text alone (special tokens as empty strings)."""
        answer = self._json(
            "/detokenize", {"tokens": [[t] for t in token_ids], "skip_special_tokens": True}
        )
        texts = answer.get("text") if isinstance(answer, dict) else None
        if not isinstance(texts, list):
            raise ServerUnreachable(f"{self.url}/detokenize answered {str(answer)[:200]}")
        return [str(t) for t in texts]

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        top_logprobs: int,
        ignore_eos: bool = False,
    ) -> dict[str, Any]:
        """A greedy answer with the top logprobs of its own tokens only. A server
        started with ``--skip-tokenizer-init`` answers ids without ``text``."""
        sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": 0}
        if ignore_eos:
            sampling["ignore_eos"] = True
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling}
        if top_logprobs:
            body.update(
                return_logprob=True,
                top_logprobs_num=top_logprobs,
                # The prompt's own logprobs are not computed for a restored prefix.
                logprob_start_len=max(len(input_ids) - 1, 0),
            )
        answer = self._json("/generate", body, timeout_s=REQUEST_TIMEOUT_S)
        if not isinstance(answer, dict) or "meta_info" not in answer:
            raise ServerUnreachable(f"{self.url}/generate answered {str(answer)[:200]}")
        return answer

    def metrics(self) -> dict[str, float]:
        """Samples summed per family, per family with each label, and per full label
        set; empty when the server exports no metrics (served without --enable-metrics)."""
        try:
            raw = self._request("/metrics", None, INFO_TIMEOUT_S)
        except ServerRefused:
            return {}
        sums: dict[str, float] = {}
        for name, labels, value in parse_prometheus(raw.decode(errors="replace")):
            full = ",".join(f'{k}="{v}"' for k, v in labels.items())
            keys = {name, f"{name}{{{full}}}" if labels else name}
            keys.update(f'{name}{{{k}="{v}"}}' for k, v in labels.items())
            for key in keys:
                sums[key] = sums.get(key, 0.0) + value
        return sums

    def flush_cache(self, timeout_s: float) -> None:
        """Drop the device and host caches. sglang refuses while a request is queued or
        in flight (an answer's bookkeeping can still be running), so retry until
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._request("/flush_cache", None, INFO_TIMEOUT_S, method="POST")
                return
            except ServerRefused as exc:
                if exc.status in (401, 403, 404, 405) or time.monotonic() > deadline:
                    raise
            time.sleep(FLUSH_RETRY_S)
