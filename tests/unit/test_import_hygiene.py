"""Layering rules per package, checked on the source and by importing with the
heavy dependencies made unimportable.

- ``span/``: pure logic; no I/O library, no torch/sglang/Mooncake.
- ``store/`` and the top-level modules: no sglang, no torch.
- only ``sglang_backend/`` (the runtime), ``bench/`` and ``testing/`` (tooling
  that builds real host pools) import sglang.
- the runtime (``span/``, ``store/``, ``sglang_backend/``, the top-level
  modules) never imports the test support in ``testing/``.
- importing the runtime backend loads no benchmark, lab, demo, cluster, CLI or
  test-support code.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mooncake_span"
IO_LIBRARIES = {
    "torch",
    "sglang",
    "mooncake",
    "socket",
    "subprocess",
    "requests",
    "urllib",
    "http",
    "etcd3gw",
    "threading",
    "os",
}
NO_SGLANG_PACKAGES = ["span", "store", "ops", "lab"]
TOP_LEVEL = ["errors", "units", "config", "storage_node", "metrics"]
SGLANG_IMPORTERS = {"sglang_backend", "bench", "testing"}
RUNTIME_PACKAGES = ["span", "store", "sglang_backend"]
TOOLING = ("mooncake_span.bench", "mooncake_span.lab", "mooncake_span.ops")
TEST_SUPPORT = "mooncake_span.testing"


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _absolute_imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved against its package."""
    package = ["mooncake_span", *path.relative_to(PACKAGE).parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def _roots(path: pathlib.Path) -> set[str]:
    return {name.split(".")[0] for name in _imports(path)}


def _modules(package: str) -> list[pathlib.Path]:
    return sorted((PACKAGE / package).rglob("*.py"))


def test_only_runtime_and_bench_packages_import_sglang():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if not SGLANG_IMPORTERS & set(path.relative_to(PACKAGE).parts) and "sglang" in _roots(path)
    ]
    assert offenders == []


def test_span_package_imports_no_io_library():
    for path in _modules("span"):
        assert not _roots(path) & IO_LIBRARIES, path.name
        outside = {
            name
            for name in _imports(path)
            if name.startswith("mooncake_span.")
            and not name.startswith(("mooncake_span.span", "mooncake_span.errors"))
        }
        assert not outside, (path.name, outside)


def test_store_package_never_imports_sglang_or_the_tooling():
    for path in _modules("store"):
        assert "sglang" not in _roots(path), path.name
        tooling = {name for name in _imports(path) if name.startswith((*TOOLING, TEST_SUPPORT))}
        assert not tooling, (path.name, tooling)


def _runtime_modules() -> list[pathlib.Path]:
    top_level = sorted(PACKAGE.glob("*.py"))
    return top_level + [path for package in RUNTIME_PACKAGES for path in _modules(package)]


def test_runtime_never_imports_the_test_support():
    modules = _runtime_modules()
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name
            for name in _absolute_imports(path)
            if name == TEST_SUPPORT or name.startswith(TEST_SUPPORT + ".")
        )
        for path in modules
    }
    for expected in ("config.py", "store/client.py", "sglang_backend/backend.py", "span/plan.py"):
        assert PACKAGE / expected in modules, expected
    assert {path: names for path, names in offenders.items() if names} == {}


def test_test_support_never_imports_the_tooling():
    """bench/ builds on testing/, never the other way round."""
    for path in _modules("testing"):
        tooling = {name for name in _absolute_imports(path) if name.startswith(TOOLING)}
        assert not tooling, (path.name, tooling)


def test_only_the_store_client_imports_mooncake():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "mooncake" in _roots(path)
        and path.relative_to(PACKAGE).parts[0] not in {"bench", "ops", "lab"}
        and path != PACKAGE / "store" / "client.py"
    ]
    assert offenders == []


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=PACKAGE.parent,
    )


def _module_level_package_imports(path: pathlib.Path) -> set[str]:
    """The other ``mooncake_span`` packages ``path`` imports in its top-level statements."""
    own = path.relative_to(PACKAGE).parts[0]
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    parts = [name.split(".") for name in names if name.startswith("mooncake_span.")]
    return {p[1] for p in parts if (PACKAGE / p[1]).is_dir() and p[1] != own}


def test_no_two_packages_import_each_other_at_module_level():
    """A package may lean on another at import time, or be leaned on, not both:
    the lower one's modules load without the upper one (lazy imports excepted)."""
    leans_on: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*/**/*.py"):
        package = path.relative_to(PACKAGE).parts[0]
        leans_on.setdefault(package, set()).update(_module_level_package_imports(path))
    mutual = sorted(
        (a, b)
        for a, others in leans_on.items()
        for b in others
        if a < b and a in leans_on.get(b, ())
    )
    assert "ops" in leans_on["lab"]  # the check sees module-level imports at all
    assert mutual == []


def test_packages_import_without_torch_sglang_or_mooncake():
    blocker = (
        "import sys\nfor m in ('torch', 'sglang', 'mooncake', 'etcd3gw'): sys.modules[m] = None\n"
    )
    names = [f"mooncake_span.{name}" for name in TOP_LEVEL]
    for package in NO_SGLANG_PACKAGES:
        for path in _modules(package):
            rel = path.relative_to(PACKAGE).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            names.append(".".join(["mooncake_span", *parts]))
    imports = "".join(f"import {name}\n" for name in names)
    result = _run(blocker + imports + "print('ok')")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_runtime_backend_loads_no_tooling_module():
    code = (
        "import sys\n"
        "from mooncake_span.sglang_backend import MooncakeSpanStore\n"
        "import mooncake_span.sglang_backend.plugin\n"
        "bad = sorted(m for m in sys.modules if m.startswith(("
        "'mooncake_span.bench', 'mooncake_span.lab', 'mooncake_span.ops', "
        "'mooncake_span.storage_node', 'mooncake_span.testing')))\n"
        "print(bad)\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


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
