"""The part of Mooncake's ``MooncakeDistributedStore`` that mooncake-span calls: the real
class and ``FakeStore`` (tools) both offer every method (``tests/unit/test_layout_rules.py``),
and ``store_contract.py`` holds the fake to the real client's behaviour. Native methods
answer with return codes, never exceptions: ``0`` or a byte count on success, a negative
``ErrorCode`` on failure, a list for batch calls (empty when the client is not set up).
"""

from __future__ import annotations

from typing import Any, Protocol


class NativeStore(Protocol):
    # Called with keywords only (the names of the wheel's keyword overload).
    def setup(
        self,
        *,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        engine: Any = ...,
        enable_ssd_offload: bool = ...,
        ssd_offload_path: str = ...,
        tenant_id: str = ...,
    ) -> int: ...

    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...

    def close(self) -> int: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: Any = ...,
    ) -> list[int]: ...

    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...

    def remove(self, key: str, force: bool = ...) -> int: ...

    def remove_all(self, force: bool = ...) -> int: ...

    def remove_by_regex(self, pattern: str, force: bool = ...) -> int: ...

    def get_size(self, key: str) -> int: ...

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]: ...

    # The SSD tier (store/ssd_tier.py): reads Mooncake asked an SSD owner for
    # (cumulative), and a graceful stop's release of this process's disk segment.
    def get_offload_rpc_read_count(self) -> int: ...

    def unmount_local_disk_segment(self, grace_period_seconds: int = ...) -> int: ...
