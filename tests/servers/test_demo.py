"""The README's main job, exactly as a user runs it, twice, right after another venv
of this Python loaded sglang's page-hash extension."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from mooncake_span_tools.lab.sglang_servers import extensions_dir

pytestmark = [
    pytest.mark.integration,
    pytest.mark.servers,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO_TIMEOUT_S = 400
EXTENSION = "hicache_hash_cpp"


def readme_main_command() -> str:
    """The README's first set-up command, without its comment."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    first = block.splitlines()[0]
    assert "mooncake-span demo" in first, first
    return first.split("#", 1)[0].strip()


def _other_venv_loads_extension(folder: pathlib.Path) -> None:
    """What a venv with another sglang path does at its first hash: sglang's loader,
    its source at another path, torch's shared default extension folder."""
    from sglang.srt.mem_cache.cpp_utils import native_hash

    source = folder / "hash_binding.cpp"
    folder.mkdir(parents=True)
    shutil.copy(pathlib.Path(native_hash.__file__).with_name("hash_binding.cpp"), source)
    code = (
        "from sglang.srt.utils.cpp_extension_loader import load_extension_with_recovery as load\n"
        f"load(name={EXTENSION!r}, sources=[{str(source)!r}], extra_cflags=['-O3', '-std=c++17'],"
        " extra_ldflags=['-lcrypto'], with_cuda=False)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)


def _our_extension_mtime() -> float | None:
    found = sorted(pathlib.Path(extensions_dir()).glob(f"{EXTENSION}/{EXTENSION}*.so"))
    return found[0].stat().st_mtime if found else None


def _run_demo(command: str) -> list[str]:
    result = subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout.splitlines()


def test_readme_demo_restores_every_page_twice_after_another_venv(tmp_path):
    command = readme_main_command()
    assert command == "./scripts/setup.sh && .venv/bin/mooncake-span demo"
    _other_venv_loads_extension(tmp_path / "other-venv")
    mtimes = []
    for _ in range(2):
        lines = _run_demo(command)
        assert "restored from L3: 1984 of 2048 prompt tokens" in "\n".join(lines), lines
        assert not [line for line in lines if "why not all" in line], lines
        assert "identical greedy output: yes" in lines
        assert lines[-1] == "demo OK"
        mtimes.append(_our_extension_mtime())
    # The servers' own extension folder: built once, never rebuilt by the other venv
    # or by the second run.
    assert mtimes[0] is not None and mtimes[0] == mtimes[1]
