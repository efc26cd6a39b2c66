"""The SGLang side of mooncake-span: the only package that imports sglang.

``MooncakeSpanStore`` is resolved lazily so that sglang's factory
(``importlib.import_module("mooncake_span.sglang_backend")`` followed by
``getattr(module, "MooncakeSpanStore")``) and the tooling modules in this
package do not pay for each other's imports.
"""

from __future__ import annotations

__all__ = ["MooncakeSpanStore"]


def __getattr__(name: str):
    if name == "MooncakeSpanStore":
        from mooncake_span.sglang_backend.backend import MooncakeSpanStore

        return MooncakeSpanStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
