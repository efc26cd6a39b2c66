"""Behaviour every store behind ``MooncakeClient`` must show (fake and real alike)."""

import pytest

# The suite lives outside test_*.py files; without this its plain asserts
# would fail with a bare AssertionError instead of pytest's explanation.
pytest.register_assert_rewrite("tests.contract.store_contract")
