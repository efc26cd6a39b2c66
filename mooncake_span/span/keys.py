"""Object-key schema. Pure. Key strings are a persistent format: change them only
with a version bump (``KEY_SCHEMA_VERSION``) and the golden tests.

``{prefix}_{page_key}_{rank}_{component}``, the prefix carrying the span geometry,
host layout and KV dtype so incompatible deployments never share a key; page keys
are opaque (validated, never re-hashed): docs/span-format.md, "Keys".
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from functools import cached_property

from mooncake_span.errors import InvalidRequestError

# ms2: an MHA-style pool (k and v) is one object per key and rank (suffix
# ``_kv``), no longer ``_k`` + ``_v``; ms1 objects read as misses.
KEY_SCHEMA_VERSION = "ms2"
MAX_PAGE_KEY_CHARS = 512

_LAYOUT_CODES = {
    "page_first": "pf",
    "page_first_direct": "pfd",
    "layer_first": "lf",
    "page_head": "ph",
    "page_first_kv_split": "pfkv",
}
_UNSAFE = re.compile(r"[^A-Za-z0-9.\-]+")
# Whitespace and control characters make keys ambiguous in logs and in
# Mooncake's metadata dumps; Mooncake itself refuses only the empty key.
_BAD_PAGE_KEY_CHARS = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028\u2029\ufeff]")


def sanitize_token(value: str) -> str:
    """Collapse anything outside [A-Za-z0-9.-] so prefix fields stay unambiguous."""
    token = _UNSAFE.sub("-", value).strip("-")
    return token or "none"


def layout_code(layout: str) -> str:
    return _LAYOUT_CODES.get(layout, sanitize_token(layout))


class RankScope(enum.Enum):
    """Which rank coordinate distinguishes a component's objects: REPLICATED, one
    object every TP rank reads (MLA KV, DSA indexer, DSv4 pools); SHARDED, a slice
    per TP rank (MHA heads, Mamba state even under MLA)."""

    REPLICATED = "replicated"
    SHARDED = "sharded"


@dataclass(frozen=True)
class RankTags:
    """The rank part of object keys, built from HiCacheStorageConfig fields."""

    replicated: str
    sharded: str

    @classmethod
    def from_ranks(
        cls,
        *,
        tp_rank: int,
        pp_rank: int = 0,
        pp_size: int = 1,
        attn_cp_rank: int = 0,
        attn_cp_size: int = 1,
        dcp_rank: int = 0,
        dcp_size: int = 1,
    ) -> RankTags:
        pp = f"_{pp_rank}" if pp_size > 1 else ""
        if dcp_size > 1:
            replicated = f"dcp{dcp_rank}_cp{attn_cp_rank}{pp}"
        else:
            # Upstream leaves the CP rank out; layer-split CP ranks then collide
            # on one key (sglang #37122), so it is added whenever CP > 1.
            parts = [f"cp{attn_cp_rank}"] if attn_cp_size > 1 else []
            parts += [str(pp_rank)] if pp_size > 1 else []
            replicated = "_".join(parts)
        cp = f"_cp{attn_cp_rank}" if attn_cp_size > 1 else ""
        return cls(replicated=replicated, sharded=f"{tp_rank}{pp}{cp}")


@dataclass(frozen=True)
class ComponentSpec:
    """One object per storage key: its name (``k``, ``kv``, ``indexer``, ``conv_0`` ...).

    ``parts``: how many of sglang's per-page pointer groups the object packs,
    in order (MHA ``kv``: 2, the k group then the v group).
    """

    name: str
    scope: RankScope
    parts: int = 1


@dataclass(frozen=True)
class KeySchema:
    model: str
    host_page_tokens: int
    pages_per_span: int
    layout: str
    kv_dtype: str
    ranks: RankTags
    tag: str | None = None

    @cached_property
    def prefix(self) -> str:
        parts = [KEY_SCHEMA_VERSION]
        if self.tag:
            parts.append(sanitize_token(self.tag))
        parts += [
            sanitize_token(self.model),
            f"h{self.host_page_tokens}x{self.pages_per_span}",
            layout_code(self.layout),
            sanitize_token(self.kv_dtype),
        ]
        return "_".join(parts)

    def suffix(self, component: ComponentSpec) -> str:
        ranks = self.ranks
        rank = ranks.replicated if component.scope is RankScope.REPLICATED else ranks.sharded
        return f"_{rank}_{component.name}"

    def object_keys(self, page_keys: list[str], components: tuple[ComponentSpec, ...]) -> list[str]:
        """Key-major, component-minor: ``[k0c0, k0c1, k1c0, ...]``."""
        prefix = self._head
        suffixes = [self.suffix(c) for c in components]
        if len(suffixes) == 1:
            (suffix,) = suffixes
            return [prefix + key + suffix for key in page_keys]
        return [prefix + key + suffix for key in page_keys for suffix in suffixes]

    def group_id(self, page_key: str) -> str:
        """Mooncake eviction group of every object of one storage key."""
        return self._head + page_key

    def domain_of(self, object_key: str) -> str:
        """The failure domain (placement key) of an object key, one for every component
        and rank of a storage key: its group id cut at the page key's first "_" (the
        suffix grammar leaves the rest ambiguous); a foreign key is its own domain."""
        head = self._head
        if not object_key.startswith(head):
            return object_key
        cut = object_key.find("_", len(head))
        return object_key if cut < 0 else object_key[:cut]

    @cached_property
    def _head(self) -> str:
        return self.prefix + "_"

    def domains(
        self, page_keys: list[str], num_components: int, group_ids: list[str] | None = None
    ) -> list[str]:
        """``domain_of`` of every object of ``object_keys(page_keys, ...)``, without
        parsing object keys: the group ids (``group_ids`` if given) unless a page key
        holds a "_"."""
        if "_" not in "".join(page_keys):
            return group_ids if group_ids is not None else self.group_ids(page_keys, num_components)
        cut = [self._head + key.split("_", 1)[0] for key in page_keys]
        return cut if num_components == 1 else [d for d in cut for _ in range(num_components)]

    def group_ids(self, page_keys: list[str], num_components: int) -> list[str]:
        """Group id of every object of ``object_keys(page_keys, ...)``, in the same order."""
        prefix = self._head
        if num_components == 1:
            return [prefix + key for key in page_keys]
        return [prefix + key for key in page_keys for _ in range(num_components)]


_STR_ONLY = frozenset({str})
# Printable ASCII without the space: what a clean ASCII key consists of.
_CLEAN_ASCII = bytes(range(0x21, 0x7F))


def _clean(text: str) -> bool:
    # ASCII: deleting every allowed byte must leave nothing, one C pass (faster
    # than str.isprintable's Unicode lookups); the regex only for non-ASCII keys.
    if text.isascii():
        return not text.encode("ascii").translate(None, _CLEAN_ASCII)
    return not _BAD_PAGE_KEY_CHARS.search(text)


def check_page_keys(page_keys: object) -> list[str]:
    """Validate sglang page keys; InvalidRequestError names the first bad one."""
    if page_keys is None:
        raise InvalidRequestError("keys is None")
    if not isinstance(page_keys, (list, tuple)):
        raise InvalidRequestError(f"keys must be a list of str, got {type(page_keys).__name__}")
    # Fast path for the common, valid case: C-level passes over all keys at once.
    if not page_keys:
        return []
    if set(map(type, page_keys)) <= _STR_ONLY:
        lengths = set(map(len, page_keys))
        if min(lengths) > 0 and max(lengths) <= MAX_PAGE_KEY_CHARS and _clean("".join(page_keys)):
            return list(page_keys)
    for index, key in enumerate(page_keys):
        if not isinstance(key, str) or not key:
            raise InvalidRequestError(f"key #{index} must be a non-empty str, got {key!r}")
        if len(key) > MAX_PAGE_KEY_CHARS:
            raise InvalidRequestError(
                f"key #{index} is {len(key)} chars long; the limit is {MAX_PAGE_KEY_CHARS}"
            )
        if _BAD_PAGE_KEY_CHARS.search(key):
            raise InvalidRequestError(
                f"key #{index} {key[:40]!r} contains whitespace or control characters"
            )
    return list(page_keys)
