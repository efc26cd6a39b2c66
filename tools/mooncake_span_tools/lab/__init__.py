"""Test laboratory: multi-host topologies in network namespaces, real sglang server processes."""
