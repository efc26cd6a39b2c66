"""The Mooncake transfer engine sglang already started in this process, if any.

0.5.23's ``MooncakeStore`` reuses it when it serves the same NIC, so memory is
not registered and RDMA connections not opened twice. The client decides the
match (``SharedEngine.serves``); this module only finds it, so that the store
package never imports sglang.
"""

from __future__ import annotations

import logging

from mooncake_span.store.native import SharedEngine

logger = logging.getLogger(__name__)


def shared_transfer_engine() -> SharedEngine | None:
    """The engine sglang started, or None (none started, or an sglang without the hook)."""
    try:
        from sglang.srt.distributed.parallel_state import get_mooncake_transfer_engine

        engine = get_mooncake_transfer_engine()
    except Exception:  # noqa: BLE001 - any failure means "no engine to reuse", as upstream
        logger.debug("mooncake-span: no shared Mooncake transfer engine to reuse", exc_info=True)
        return None
    if engine is None:
        return None
    return SharedEngine(
        session_id=str(engine.get_session_id()),
        ib_device=str(engine.get_ib_device() or ""),
        engine=engine.get_engine,
    )
