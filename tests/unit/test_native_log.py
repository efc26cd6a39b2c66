"""native_stderr: fd 2 goes to the file, Python's stderr and logging stay visible."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from mooncake_span.ops.cli_common import resolve_native_log

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_native_lines_go_to_the_file_and_python_lines_stay(tmp_path):
    log = tmp_path / "native.log"
    result = _run(
        f"""
        import logging, os, sys
        from mooncake_span_tools.native_stderr import native_stderr_to
        logging.basicConfig(level=logging.WARNING)
        with native_stderr_to({str(log)!r}):
            os.write(2, b"I1130 native glog line\\n")
            print("python stderr line", file=sys.stderr)
            logging.getLogger("x").warning("python log line")
        os.write(2, b"after the block\\n")
        """
    )
    assert result.returncode == 0, result.stderr
    assert log.read_text() == "I1130 native glog line\n"
    assert "native glog line" not in result.stderr
    assert "python stderr line" in result.stderr and "python log line" in result.stderr
    assert "after the block" in result.stderr


def test_dash_keeps_stderr_and_default_is_a_fresh_file():
    assert resolve_native_log("-", "demo") is None
    assert resolve_native_log("/x/y.log", "demo") == "/x/y.log"
    first, second = resolve_native_log(None, "demo"), resolve_native_log(None, "demo")
    assert first != second and Path(first).parent.name.startswith("mooncake-span-demo-")
