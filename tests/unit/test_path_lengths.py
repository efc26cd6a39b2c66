"""The two data paths, counted as docs/architecture.md counts them, stay within the bound.

The page's table under "How the two paths are counted" lists, per path, the
functions a zero-copy call reads through from sglang's method down to the
Mooncake data call. Each function is counted whole, as ``inspect`` finds it
(decorators, signature, docstring, body): its whole lines, and its code lines
(the same without the docstring, comment-only and blank lines). The page's
figures must be the code's, and the put must stay within 150 lines, whole and code.

The table leaves out the owners a listed function calls by one name. What a
reader of the put must read in all is every function it passes through: that
is traced (``test_put_files.traced_put``: one healthy put of each pool set,
the wrappers and the native-code tables left out as there), counted the same
way, and the page's figure for it must be the code's too.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import textwrap

from tests.unit.test_put_files import glm_dsa_k4, mla_k1, steady_put

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PUT_BOUND_LINES = 150


def _function(dotted: str):
    """``pkg/module.Class.method`` (or ``pkg/module.function``) of the package."""
    path, *attrs = dotted.split(".")
    target = importlib.import_module("mooncake_span." + path.replace("/", "."))
    for attr in attrs:
        target = getattr(target, attr)
    return inspect.unwrap(target.fget if isinstance(target, property) else target)


def line_counts(function) -> tuple[int, int]:
    """(code lines, whole lines) of one function."""
    lines, _ = inspect.getsourcelines(function)
    source = textwrap.dedent("".join(lines))
    body = ast.parse(source).body[0].body
    docstring: set[int] = set()
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            docstring = set(range(first.lineno, first.end_lineno + 1))
    code = [
        line
        for number, line in enumerate(source.splitlines(), 1)
        if number not in docstring and line.strip() and not line.strip().startswith("#")
    ]
    return len(code), len(lines)


def _rows() -> dict[str, tuple[list[str], int, int]]:
    """Per path of the page's table: its functions, code lines and whole lines."""
    section = DOC.read_text().split("\n### How the two paths are counted\n", 1)[1]
    rows = {}
    for line in section.split("\n#", 1)[0].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2].isdigit():
            rows[cells[0]] = (re.findall(r"`([^`]+)`", cells[1]), int(cells[2]), int(cells[3]))
    return rows


def _sample(x: int) -> int:
    """A docstring of
    two lines."""
    # a comment

    return x  # a trailing comment keeps its line


def test_the_counter_leaves_out_docstrings_comments_and_blank_lines():
    assert line_counts(_sample) == (2, 6)


def test_the_page_counts_both_paths_as_the_code_stands():
    rows = _rows()
    assert set(rows) == {"put", "get"}
    for path, (names, code_lines, whole_lines) in rows.items():
        counts = [line_counts(_function(name)) for name in names]
        measured = (sum(c for c, _ in counts), sum(w for _, w in counts))
        per_function = dict(zip(names, counts, strict=True))
        assert measured == (code_lines, whole_lines), f"{path}: {measured}; {per_function}"


def test_the_put_reads_within_the_bound():
    names, _, _ = _rows()["put"]
    assert names[0] == "sglang_backend/writes.WritePath.batch_set_v1"
    assert names[-1] == "store/gate.NativeCalls.put_call"
    counts = [line_counts(_function(name)) for name in names]
    assert sum(code for code, _ in counts) <= PUT_BOUND_LINES
    assert sum(whole for _, whole in counts) <= PUT_BOUND_LINES


def _traced_figure() -> tuple[int, int, int]:
    """The page's (functions, code lines, whole lines) of every function the put passes through."""
    section = DOC.read_text().split("\n### How the two paths are counted\n", 1)[1]
    found = re.search(
        r"traced put passes\s+through\s+(\d+)\s+functions:\s+(\d+)\s+code\s+lines,\s+(\d+)\s+whole"
        r"\s+lines",
        section,
    )
    assert found, "the page states no figure for the traced put"
    return int(found[1]), int(found[2]), int(found[3])


def test_the_page_counts_every_function_the_traced_put_passes_through(make_backend):
    functions: dict[str, object] = {}
    for shape in (mla_k1, glm_dsa_k4):
        functions |= steady_put(make_backend, shape).functions
    counts = {name: line_counts(code) for name, code in sorted(functions.items())}
    measured = (len(counts), sum(c for c, _ in counts.values()), sum(w for _, w in counts.values()))
    assert measured == _traced_figure(), f"{measured}; {counts}"
    # From sglang's method down to the Mooncake data call, as the table's put row.
    assert {
        "sglang_backend/writes.py:WritePath.batch_set_v1",
        "store/gate.py:NativeCalls.put_call",
    } <= set(counts)
