"""docs/architecture.md may only name code that exists.

Every code span of the page is classified and checked against the package as
it is now, so renaming or deleting a module, class or function without
updating the page fails here:

- ``pkg/module.py`` (or ``mooncake_span/...``, ``tools/...``, ``tests/...``, ``docs/...``): the
  file exists; ``pkg`` is a package of either distribution (``mooncake_span`` at the root,
  ``mooncake_span_tools`` under tools/);
- ``pkg/module.Name[.attr]`` and ``module.Name[.attr]``: the module imports and the
  attribute chain resolves (``module.method``: a method of one of the module's classes);
- ``mooncake_span_<family>``: a metric family ``metrics.py`` defines;
- ``Name[.attr]`` (CamelCase) and bare ``snake_case`` identifiers: defined somewhere in the
  package or its tests (a module, class, function, method or module-level name), an option
  key of ``config.py``, or one of the few
  sglang / Mooncake / tool names the page talks about (``EXTERNAL``).

Names are also checked against the module the page credits them to: in the
"Packages" table, every such name in a row's role column lives in the row's
module (for a package row, in a module of that package): it is defined there,
or the module imports it (what the module takes or hands back, named for
context). A name credited to a module that neither defines nor imports it
fails, even if some other module defines it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import re
import sys

import pytest

from mooncake_span import config

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mooncake_span"
# Both distributions' packages: the serving one first, then the tooling.
PACKAGES = {"mooncake_span": PACKAGE, "mooncake_span_tools": ROOT / "tools" / "mooncake_span_tools"}
DOC = ROOT / "docs" / "architecture.md"
METRICS_SOURCE = (PACKAGE / "metrics.py").read_text()

# Names of sglang, Mooncake and other tools that the page mentions on purpose.
EXTERNAL = {
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheController",
    "HybridCacheController",
    "PoolTransfer",
    "PoolTransferResult",
    "StorageMetrics",
    "MooncakeStore",
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "StorageBackendFactory",
    "InstrumentedRemoteConnector",
    "batch_get_into_multi_buffers",
    "batch_put_from_multi_buffers",
    "batch_is_exist",
    "batch_get_replica_desc",
    "register_buffer",
    "get_page_buffer_meta",
    "register_mem_pool_host",
    "register_mem_host_pool_v2",
    "on_host_pools_registered",
    "load_plugins",
    "etcd3gw",
    "prometheus_client",
    "setns",
    "service_ready",
    "sglang_router",
}

_PATH = re.compile(r"^[\w./-]+\.(?:py|toml)$")
_DOTTED = re.compile(r"^(?:[a-z_]+/)*[a-z_]+(?:\.[A-Za-z_]\w*)+$")
_CAMEL = re.compile(r"^[A-Z][a-z]+[A-Za-z0-9]*(?:\.[A-Za-z_]\w*)*$")
_SNAKE = re.compile(r"^_?[a-z]+(?:_[a-z0-9]+)+$")


def _spans() -> list[str]:
    text = DOC.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks are examples
    return sorted(set(re.findall(r"`([^`\n]+)`", text)))


# Option keys are names the page may use too (span_*, sglang's keys we read).
OPTION_KEYS = {"mooncake_span", *config._SPAN_KEYS, *config.FOREIGN_KEYS}


def _names_of(paths: list[pathlib.Path], imported: bool = False) -> set[str]:
    """The stems of ``paths`` and every name they define (and, if ``imported``, import)."""
    names: set[str] = set()
    for path in paths:
        names |= _file_names(path, imported)
    return names


# Every row of the table reads the same files again: each is parsed once a run.
@functools.cache
def _file_names(path: pathlib.Path, imported: bool) -> frozenset[str]:
    names = {path.stem}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
                    elif isinstance(leaf, ast.Attribute):
                        names.add(leaf.attr)
        elif imported and isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name for alias in node.names)
    return frozenset(names)


def _defined_names() -> set[str]:
    sources = [path for base in PACKAGES.values() for path in base.rglob("*.py")]
    return OPTION_KEYS | set(PACKAGES) | _names_of([*sources, *(ROOT / "tests").rglob("*.py")])


def _module_for(dotted: str) -> tuple[object, list[str]] | None:
    """Import the longest package module prefix of ``dotted``; the rest is attributes."""
    head, *rest = dotted.split(".")
    candidates = [head.replace("/", ".")]
    if "/" not in head:
        candidates += [
            ".".join([top, *p.relative_to(base).with_suffix("").parts])
            for top, base in PACKAGES.items()
            for p in base.rglob(f"{head}.py")
        ]
    names = [
        candidate if candidate.split(".")[0] in PACKAGES else f"{top}.{candidate}"
        for candidate in candidates
        for top in PACKAGES
    ]
    for name in dict.fromkeys(names):
        try:
            return importlib.import_module(name), rest
        except ImportError:
            continue
    return None


def _resolves(module: object, attrs: list[str]) -> bool:
    """``module.a.b``; ``module.method`` also names a method of a class of the module."""
    if attrs and not hasattr(module, attrs[0]):
        owners = [c for c in vars(module).values() if isinstance(c, type) and hasattr(c, attrs[0])]
        if not owners:
            return False
        module = owners[0]
    target = module
    for attr in attrs:
        if not hasattr(target, attr):
            return False
        target = getattr(target, attr)
    return True


def _problem(span: str, defined: set[str]) -> str | None:
    token = span.split("(")[0].strip()
    if _PATH.match(token):
        found = (
            (ROOT / token).exists()
            or any((base / token).exists() for base in PACKAGES.values())
            or any((ROOT / "tests").rglob(token))
        )
        return None if found else "no such file"
    foreign = token.split(".")[0] in sys.stdlib_module_names | {"sglang", "mooncake", "torch"}
    if _DOTTED.match(token) and not foreign:
        located = _module_for(token)
        if located is None:
            return "no such module"
        return None if _resolves(*located) else "no such attribute"
    first = token.split(".")[0]
    if token.startswith("mooncake_span_") and not token.endswith("*") and token not in PACKAGES:
        family = token.removeprefix("mooncake_span_")
        return None if f'"{family}"' in METRICS_SOURCE else "no such metric family"
    if _CAMEL.match(token):
        return None if first in defined or first in EXTERNAL else "not defined in the package"
    if _SNAKE.match(token):
        return None if token in defined or token in EXTERNAL else "not defined in the package"
    return None


def _package_rows() -> list[tuple[list[str], list[str]]]:
    """Per row of the "Packages" table: the modules it is about, and its role's code spans."""
    table = DOC.read_text().split("\n## Packages\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            rows.append((re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([^`]+)`", cells[1])))
    return rows


def _credit_problem(modules: list[str], span: str) -> str | None:
    """Why ``span`` (a role's code span) does not live in ``modules``, or None."""
    token = span.split("(")[0].strip()
    if not (_CAMEL.match(token) or _SNAKE.match(token)):
        return None  # paths, dotted module names and metrics are checked where they point
    first = token.split(".")[0]
    if first in EXTERNAL or first in OPTION_KEYS:
        return None
    paths: list[pathlib.Path] = []
    for module in modules:
        where = next(
            (base / module for base in PACKAGES.values() if (base / module).exists()),
            PACKAGE / module,
        )
        paths += sorted(where.rglob("*.py")) if module.endswith("/") else [where]
    if first in _names_of(paths, imported=True):
        return None
    return f"neither defined nor imported in {', '.join(modules)}"


def test_every_name_in_the_package_table_lives_in_the_module_it_is_credited_to():
    problems = {
        (modules[0], span): why
        for modules, spans in _package_rows()
        for span in spans
        if (why := _credit_problem(modules, span))
    }
    assert problems == {}


def test_a_name_credited_to_the_wrong_module_is_reported():
    assert _credit_problem(["sglang_backend/stager.py"], "Stager") is None
    assert _credit_problem(["sglang_backend/stager.py"], "MooncakeSpanStore") is not None
    assert _credit_problem(["store/"], "DomainRouter") is None
    assert _credit_problem(["span/"], "DomainRouter") is not None


def test_every_code_name_on_the_architecture_page_exists():
    defined = _defined_names()
    problems = {span: why for span in _spans() if (why := _problem(span, defined))}
    assert problems == {}


@pytest.mark.parametrize(
    "span",
    [
        "store/no_such_module.py",
        "store/client.NoSuchClass",
        "NoSuchRouter",
        "no_such_function",
        "mooncake_span_no_such_total",
    ],
)
def test_a_missing_name_is_reported(span):
    assert _problem(span, _defined_names()) is not None
