"""The README's main job, as a user runs it: ``mooncake-span demo``."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.servers,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]


def test_demo_command_restores_from_l3():
    result = subprocess.run(
        [sys.executable, "-m", "mooncake_span.ops.cli", "demo", "--prompt-tokens", "640"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "restored from L3: 576 of 640 prompt tokens" in result.stdout, lines
    assert "identical greedy output: yes" in lines
    assert lines[-1] == "demo OK"
