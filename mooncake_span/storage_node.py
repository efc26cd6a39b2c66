"""Public entry point ``python -m mooncake_span.storage_node`` (code: ``ops/storage_process``)."""

from mooncake_span.ops.storage_process import main

if __name__ == "__main__":
    raise SystemExit(main())
