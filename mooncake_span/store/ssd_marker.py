"""The cluster's SSD-tier marker: whether objects there can outlive Mooncake's checksums.

Every process with an SSD tier stores ``MARKER_KEY``; a client whose
``span_object_checksums`` is not given seals where it exists or where it has a tier
of its own. Why: docs/reliability.md, "Seals on by default where there is an SSD tier".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from mooncake_span.errors import ConfigError, ErrorCode
from mooncake_span.span.keys import KEY_SCHEMA_VERSION

logger = logging.getLogger(__name__)

MARKER_KEY = f"{KEY_SCHEMA_VERSION}__ssd_tier"


def publish(put: Callable[[str, bytes], int], segment: str) -> None:
    """Store the marker through ``put`` (a native put of ``MARKER_KEY`` onto this
    process's own segment, hard-pinned; answers its code); ConfigError if refused.
    The value names who published it, for an operator reading the marker."""
    code = put(MARKER_KEY, json.dumps({"ssd_tier": True, "published_by": segment}).encode())
    if code not in (0, ErrorCode.OBJECT_ALREADY_EXISTS):
        raise ConfigError(
            f"could not store the SSD-tier marker {MARKER_KEY} (code {code}); without it "
            "clients of this cluster would not seal their objects (store/ssd_marker.py)"
        )


def resolve_object_checksums(
    given: bool | None, own_tier: bool, cluster_has_tier: Callable[[], bool], guard: str
) -> tuple[bool, str]:
    """(whether this client seals and verifies its objects, why). ``given``:
    ``span_object_checksums`` (None: not given); ``own_tier``: this process keeps its
    segment on an SSD too; ``cluster_has_tier``: whether the marker exists (asked only
    when needed). ConfigError: ``given`` is False on a cluster with a tier, the guard on.
    """
    if given is True:
        return True, "span_object_checksums"
    tier = "this process's SSD tier" if own_tier else None
    if tier is None and cluster_has_tier():
        tier = f"an SSD tier in the cluster ({MARKER_KEY})"
    if given is None:
        return (True, tier) if tier else (False, "no SSD tier in the cluster")
    if tier is None:
        return False, "span_object_checksums"
    if guard != "off":
        raise ConfigError(
            f"span_object_checksums is false but this cluster keeps objects on SSD ({tier}), "
            "where rot would be served as wrong pages: remove span_object_checksums (it seals "
            "by default there) or set it true"
        )
    logger.warning(
        "mooncake-span: span_object_checksums is false with %s and the layout guard off: "
        "objects read from SSD after a restart are not verified",
        tier,
    )
    return False, "span_object_checksums (guard off)"
