"""mooncake-span: SGLang HiCache L3 storage on Mooncake, K host pages per key."""

__version__ = "0.1.0"
