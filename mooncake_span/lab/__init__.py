"""Test laboratory: multi-host topologies in network namespaces."""
