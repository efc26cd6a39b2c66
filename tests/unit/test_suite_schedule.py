"""How the parallel suite is scheduled (tests/conftest.py): at most two lanes hold
real servers, every other test's unit is its module, and servers go out first."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import _SHARED_GROUPS, _folder_rank, xdist_group_of

TESTS = Path(__file__).resolve().parents[1]


def test_every_server_module_runs_in_one_of_two_lanes():
    modules = sorted(f"tests/servers/{p.name}" for p in (TESTS / "servers").glob("test_*.py"))
    lanes = {xdist_group_of(f"{module}::test_x") for module in modules}
    assert lanes == {"servers-lane-a", "servers-lane-b"}
    # The table names only modules that exist (a renamed module would leave its lane).
    assert set(_SHARED_GROUPS) <= set(modules)
    assert xdist_group_of("tests/servers/test_not_placed_yet.py::test_x") == "servers-lane-b"


def test_other_tests_are_grouped_by_module():
    assert xdist_group_of("tests/unit/test_a.py::test_x[1]") == "tests/unit/test_a.py"
    assert xdist_group_of("tests/unit/test_a.py::Case::test_y") == "tests/unit/test_a.py"
    assert xdist_group_of("tests/netns/test_b.py::test_z") == "tests/netns/test_b.py"


def test_servers_go_out_first_and_unit_modules_last():
    ranks = [
        _folder_rank(f"tests/{folder}/test_m.py::test_x")
        for folder in ("servers", "netns", "faults", "integration", "contract", "unit")
    ]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    assert _folder_rank("tests/servers/test_m.py::t") < _folder_rank("tests/unit/test_m.py::t")
