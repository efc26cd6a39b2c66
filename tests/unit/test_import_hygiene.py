"""Layering rules, checked on the source and by importing with the heavy
dependencies made unimportable."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mooncake_span"
PURE = ["geometry", "keys", "hits", "plan", "breaker", "units", "errors", "config"]
NO_SGLANG = PURE + ["client", "fake_store", "layout_guard", "cluster", "storage_node", "cli"]


def _top_level_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_sglang_backend_package_imports_sglang():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "sglang_backend" not in path.parts and "sglang" in _top_level_imports(path)
    ]
    assert offenders == []


def test_pure_modules_import_no_io_libraries():
    for name in PURE:
        imports = _top_level_imports(PACKAGE / f"{name}.py")
        assert not imports & {"torch", "sglang", "mooncake", "socket", "subprocess", "requests"}, name


def test_modules_import_without_torch_sglang_or_mooncake():
    blocker = "import sys\nfor m in ('torch', 'sglang', 'mooncake', 'etcd3gw'): sys.modules[m] = None\n"
    imports = "".join(f"import mooncake_span.{name}\n" for name in NO_SGLANG)
    result = subprocess.run(
        [sys.executable, "-c", blocker + imports + "print('ok')"],
        capture_output=True, text=True, timeout=60, cwd=PACKAGE.parent,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_library_never_configures_the_root_logger():
    """Only a process entry point (a function named main) may call basicConfig."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        allowed = {
            id(call)
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef) and fn.name == "main"
            for call in ast.walk(fn)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "basicConfig"
                and id(node) not in allowed
            ):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []
