"""The serving wheel: what ``pip wheel .`` at the root builds holds the runtime
and the operator's commands, and nothing of the tooling distribution (tools/).

The wheel is built from a copy of the serving sources (so the test writes nothing
into the checkout) and unpacked; its CLI then runs on the standard library
alone, as on a host without the tooling, sglang or Mooncake.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 240
RUN_TIMEOUT_S = 60
# The wheel's Python today, in lines; issue #48's target is 13,000, missed by the
# difference (docs/architecture.md says what fills it). A change that grows the
# wheel past this says so here.
WHEEL_PYTHON_LINES_BOUND = 13_873


@pytest.fixture(scope="module")
def serving_wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(
        ROOT / "mooncake_span", src / "mooncake_span", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + [str(src), "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT_S,
    )
    (wheel,) = out.glob("mooncake_span-*.whl")
    return wheel


@pytest.fixture(scope="module")
def unpacked(serving_wheel, tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("unpacked")
    with zipfile.ZipFile(serving_wheel) as archive:
        archive.extractall(where)
    return where


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_serving_wheel_holds_the_serving_package_alone(serving_wheel):
    names = _names(serving_wheel)
    tops = {name.split("/")[0] for name in names}
    assert tops == {"mooncake_span", "mooncake_span-0.1.0.dist-info"}
    tooling = [n for n in names if {"bench", "lab", "testing"} & set(Path(n).parts)]
    assert tooling == []
    for expected in ("ops/cli.py", "ops/doctor.py", "ops/validate.py", "storage_node.py"):
        assert f"mooncake_span/{expected}" in names, expected


def test_the_serving_wheels_python_stays_within_its_bound(serving_wheel):
    with zipfile.ZipFile(serving_wheel) as archive:
        python = [n for n in archive.namelist() if n.endswith(".py")]
        lines = sum(archive.read(n).count(b"\n") for n in python)
    assert python and lines <= WHEEL_PYTHON_LINES_BOUND, f"{lines} lines in {len(python)} files"


def test_the_serving_wheel_declares_the_cli_and_the_sglang_plugin_only(unpacked):
    entry_points = (unpacked / "mooncake_span-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "mooncake-span = mooncake_span.ops.cli:main" in entry_points
    assert "mooncake_span = mooncake_span.sglang_backend.plugin:register" in entry_points
    assert "mooncake_span.commands" not in entry_points


def _cli(unpacked: Path, *argv: str) -> subprocess.CompletedProcess:
    """The unpacked wheel's CLI on the standard library alone: no site-packages,
    no PYTHONPATH, so neither the tooling nor this checkout can be imported."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(unpacked)!r})\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('mooncake_span_tools') is None\n"
        "from mooncake_span.ops.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-E", "-S", "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=unpacked,
    )


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--quick", "--help"], ["demo"], ["soak"]])
def test_a_tooling_command_without_the_tooling_says_how_to_install_it(unpacked, argv):
    result = _cli(unpacked, *argv)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"mooncake-span {argv[0]}: not installed here") and "./tools" in line


@pytest.mark.parametrize(
    "argv",
    [["cluster", "up", "--help"], ["doctor", "--help"], ["inspect", "--help"]]
    + [["validate", "--help"]],
)
def test_the_operator_commands_run_without_the_tooling(unpacked, argv):
    result = _cli(unpacked, *argv)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: mooncake-span {' '.join(argv[:-1])}")
