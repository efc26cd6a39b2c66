"""One serving rank with its own SSD tier, as a process of its own: ``write`` backs up
the ``Keys`` and closes the backend at once; ``read`` restores them on a new backend
over the same rank directory and prints ``RESULT <json>`` (rows missed, rows wrong).

Not collected (no ``test_`` prefix). A process each, as a restarted server is: a
second backend that sets up in the process of the first reads its own disk replicas
wrong (TRANSFER_FAIL, and bytes its seal rejects), which no restart does.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from tests.integration.ssd_keys import SEGMENT_BYTES, Keys, missed_and_wrong

CLIENT_CONFIG_ENV = "SSD_RANK_CLIENT_CONFIG"
DIRECTORY_ENV = "SSD_RANK_DIRECTORY"


class _Cluster:
    """What ``Keys`` asks of a cluster, from the parent's environment."""

    def client_config(self) -> dict[str, Any]:
        return json.loads(os.environ[CLIENT_CONFIG_ENV])


def main(role: str) -> None:
    keys = Keys(
        _Cluster(),  # type: ignore[arg-type]
        "rank",
        global_segment_size=SEGMENT_BYTES,
        enable_ssd_offload=True,
        ssd_offload_path=os.environ[DIRECTORY_ENV],
        span_layout_guard="off",  # its record would sit on this rank's segment alone
    )
    if role == "write":
        keys.write_all(wait_on_disk=False)
        keys.store.close()
        return
    missed, wrong = missed_and_wrong(keys)
    keys.store.close()
    print("RESULT " + json.dumps({"missed": missed, "wrong": wrong}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
