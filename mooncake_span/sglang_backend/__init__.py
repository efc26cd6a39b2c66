"""The SGLang side of mooncake-span: the only package that imports sglang.

``MooncakeSpanStore`` resolves lazily (sglang's factory imports this package,
then getattr()s the class), so the tooling modules here do not pay for it.
"""

from __future__ import annotations

__all__ = ["MooncakeSpanStore"]


def __getattr__(name: str):
    if name == "MooncakeSpanStore":
        from mooncake_span.sglang_backend.backend import MooncakeSpanStore

        return MooncakeSpanStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
