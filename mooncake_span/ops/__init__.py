"""Operator tooling: the ``mooncake-span`` CLI, the local Mooncake cluster and
the storage-node process."""
