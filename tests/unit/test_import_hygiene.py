"""Layering rules per package, checked on the source and by importing with the
heavy dependencies made unimportable.

Two distributions: the serving one (``mooncake_span``: the runtime and the
operator commands) and the tooling one (``tools/``, ``mooncake_span_tools``:
benchmarks, lab, CPU stand-ins and test support, demos).

- ``span/``: pure logic; no I/O library, no torch/sglang/Mooncake.
- ``store/`` and the top-level modules: no sglang, no torch.
- only ``sglang_backend/`` (the runtime) and the tooling's ``bench/`` and
  ``testing/`` (which build real host pools) import sglang.
- the serving distribution never imports the tooling one, by any import
  statement (inside functions and under ``TYPE_CHECKING`` too) or by name
  through ``importlib``; the tooling's commands reach the CLI through entry points.
- the runtime (``span/``, ``store/``, ``sglang_backend/``, the top-level
  modules but the storage node) never imports the operator commands (``ops/``).
- the packages of both distributions form one-way layers: counting every import
  statement, wherever it stands, no package reaches back to one that imports it.
- importing the runtime backend loads no benchmark, lab, demo, cluster, CLI or
  test-support code.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mooncake_span"
TOOLS = ROOT / "tools" / "mooncake_span_tools"
DISTRIBUTIONS = {"mooncake_span": PACKAGE, "mooncake_span_tools": TOOLS}
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
NO_SGLANG_PACKAGES = [PACKAGE / "span", PACKAGE / "store", PACKAGE / "ops", TOOLS / "lab"]
TOP_LEVEL = ["errors", "units", "config", "storage_node", "metrics"]
SGLANG_IMPORTERS = [PACKAGE / "sglang_backend", TOOLS / "bench", TOOLS / "testing"]
# the runtime reaches Mooncake only through store/client.py; the tooling may go direct
MOONCAKE_IMPORTERS = [PACKAGE / "store" / "client.py", PACKAGE / "ops", TOOLS]
RUNTIME_PACKAGES = ["span", "store", "sglang_backend"]
OPS = "mooncake_span.ops"
TOOLING = "mooncake_span_tools"


def _all_modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted(TOOLS.rglob("*.py"))


def _under(path: pathlib.Path, places: list[pathlib.Path]) -> bool:
    return any(path == place or place in path.parents for place in places)


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _module_name(path: pathlib.Path) -> str:
    top, base = next((t, b) for t, b in DISTRIBUTIONS.items() if b in path.parents)
    parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
    return ".".join([top, *parts])


def _package_of(path: pathlib.Path) -> list[str]:
    top, base = next((t, b) for t, b in DISTRIBUTIONS.items() if b in path.parents)
    return [top, *path.relative_to(base).parent.parts]


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _statement_imports(tree: ast.AST, package: list[str]) -> set[str]:
    """Every module an import statement of ``tree`` names, wherever the statement
    stands (module level, a function, ``if TYPE_CHECKING``), relative ones resolved
    against ``package``; ``from m import x`` counts as ``m`` and ``m.x``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


_DYNAMIC_IMPORTS = {"import_module", "__import__", "find_spec"}


def _named_imports(tree: ast.AST) -> set[str]:
    """Modules named as a literal to ``importlib.import_module``, ``__import__`` or
    ``find_spec``: imports all the same."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = node.func
            name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", "")
            if name in _DYNAMIC_IMPORTS and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def _absolute_imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, by statement or by name."""
    tree = ast.parse(path.read_text())
    return _statement_imports(tree, _package_of(path)) | _named_imports(tree)


def _roots(path: pathlib.Path) -> set[str]:
    return {name.split(".")[0] for name in _imports(path)}


def _modules(package: str) -> list[pathlib.Path]:
    return sorted((PACKAGE / package).rglob("*.py"))


def test_only_the_adapter_and_the_tooling_that_builds_host_pools_import_sglang():
    offenders = [
        _rel(path)
        for path in _all_modules()
        if not _under(path, SGLANG_IMPORTERS) and "sglang" in _roots(path)
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


def test_store_package_never_imports_sglang():
    for path in _modules("store"):
        assert "sglang" not in _roots(path), path.name


def _runtime_modules() -> list[pathlib.Path]:
    top_level = [path for path in sorted(PACKAGE.glob("*.py")) if path.stem != "storage_node"]
    return top_level + [path for package in RUNTIME_PACKAGES for path in _modules(package)]


def _importing(paths: list[pathlib.Path], prefixes: tuple[str, ...]) -> dict[str, list[str]]:
    found = {
        _rel(path): sorted(
            name
            for name in _absolute_imports(path)
            if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)
        )
        for path in paths
    }
    return {path: names for path, names in found.items() if names}


def test_runtime_never_imports_the_operator_commands_or_the_tooling():
    modules = _runtime_modules()
    for expected in ("config.py", "store/client.py", "sglang_backend/backend.py", "span/plan.py"):
        assert PACKAGE / expected in modules, expected
    assert _importing(modules, (OPS, TOOLING)) == {}


def test_serving_distribution_never_imports_the_tooling():
    """Not at module level, not inside a function, not by name: a serving rank has
    no tooling installed, and the CLI finds the tooling's commands by entry point."""
    assert _importing(sorted(PACKAGE.rglob("*.py")), (TOOLING,)) == {}


def test_imports_inside_functions_and_by_name_are_seen():
    tree = ast.parse(
        "import importlib\n\n\ndef later():\n"
        "    from ..bench import runner\n"
        "    if runner:\n"
        "        return importlib.import_module('mooncake_span_tools.lab.soak')\n"
    )
    seen = _statement_imports(tree, ["mooncake_span_tools", "lab"]) | _named_imports(tree)
    assert {"mooncake_span_tools.bench.runner", "mooncake_span_tools.lab.soak"} <= seen


def test_test_support_never_imports_the_rest_of_the_tooling():
    """bench/, lab/ and the commands build on testing/, never the other way round."""
    paths = sorted((TOOLS / "testing").rglob("*.py"))
    rest = tuple(f"{TOOLING}.{child.stem}" for child in TOOLS.iterdir() if child.name != "testing")
    assert _importing(paths, (*rest, OPS)) == {}


def test_only_the_store_client_imports_mooncake():
    offenders = [
        _rel(path)
        for path in _all_modules()
        if "mooncake" in _roots(path) and not _under(path, MOONCAKE_IMPORTERS)
    ]
    assert offenders == []


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )


def _unit(module: str) -> str | None:
    """The package or top-level module of either distribution that ``module`` lies in."""
    top, *rest = module.split(".")
    base = DISTRIBUTIONS.get(top)
    if base is None:
        return None
    if rest and ((base / rest[0]).is_dir() or (base / f"{rest[0]}.py").is_file()):
        return f"{top}.{rest[0]}"
    return top


def _package_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {unit it imports: the files that do}, counting every import statement."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in _all_modules():
        own = _unit(_module_name(path))
        edges = graph.setdefault(own, {})
        for other in {_unit(name) for name in _absolute_imports(path)} - {None, own}:
            edges.setdefault(other, []).append(_rel(path))
    return graph


def _cycle(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """One cycle of ``graph`` as [a, b, ..., a], or [] when it has none."""
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> list[str]:
        if node in trail:
            return trail[trail.index(node) :] + [node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, {})):
            if found := visit(nxt, [*trail, node]):
                return found
        done.add(node)
        return []

    for start in sorted(graph):
        if found := visit(start, []):
            return found
    return []


def test_packages_form_one_way_layers():
    """Counting every import statement, inside functions too, no package of either
    distribution reaches back to one that reaches it: each lower one works without
    the upper, and the tooling sits above the serving distribution."""
    graph = _package_graph()
    # the graph holds imports made only inside functions (the commands load the lab lazily)
    assert "mooncake_span_tools.lab" in graph["mooncake_span_tools.commands"]
    cycle = _cycle(graph)
    assert cycle == [], [(a, b, graph[a][b]) for a, b in zip(cycle, cycle[1:], strict=False)]


def test_a_cycle_between_packages_is_found():
    assert _cycle({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": []}, "b": {"c": []}, "c": {}}) == []


def test_packages_import_without_torch_sglang_or_mooncake():
    blocker = (
        "import sys\nfor m in ('torch', 'sglang', 'mooncake', 'etcd3gw'): sys.modules[m] = None\n"
    )
    names = [f"mooncake_span.{name}" for name in TOP_LEVEL]
    names += [
        _module_name(path) for place in NO_SGLANG_PACKAGES for path in sorted(place.rglob("*.py"))
    ]
    imports = "".join(f"import {name}\n" for name in names)
    result = _run(blocker + imports + "print('ok')")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_runtime_backend_loads_no_tooling_module():
    code = (
        "import sys\n"
        "from mooncake_span.sglang_backend import MooncakeSpanStore\n"
        "import mooncake_span.sglang_backend.plugin\n"
        "bad = sorted(m for m in sys.modules if m.startswith(("
        "'mooncake_span_tools', 'mooncake_span.ops', 'mooncake_span.storage_node')))\n"
        "print(bad)\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_library_never_configures_the_root_logger():
    """Only a process entry point (a function named main) may call basicConfig."""
    offenders = []
    for path in _all_modules():
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
