"""Which Mooncake build is installed: every distribution on PyPI that provides
``mooncake`` is recognised by ``doctor`` and named by the setup error."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from mooncake_span.errors import SetupError
from mooncake_span.ops import doctor
from mooncake_span.ops.doctor_host import FAIL, PASS, WARN, Context
from mooncake_span.store import client, native
from mooncake_span.store.native import MooncakeBuild

# What pip installs, as importlib.metadata spells the names it reads from each wheel.
WHEEL_NAMES = {
    "mooncake_transfer_engine_non_cuda": ("mooncake-transfer-engine-non-cuda", "CPU hosts, TCP"),
    "mooncake-transfer-engine": ("mooncake-transfer-engine", "CUDA 12 hosts"),
    "mooncake_transfer_engine_cuda13": ("mooncake-transfer-engine-cuda13", "CUDA 13 hosts"),
    "mooncake_transfer_engine_efa": ("mooncake-transfer-engine-efa", "AWS EFA hosts"),
}


def _installed(*names: str, versions: dict[str, str] | None = None) -> list[MooncakeBuild]:
    return native.installed_mooncake(
        provided=lambda: {"mooncake": list(names), "torch": ["torch"]},
        version=lambda name: (versions or {}).get(name, "0.3.14"),
    )


@pytest.mark.parametrize("wheel_name", sorted(WHEEL_NAMES))
def test_every_build_is_recognised_by_what_provides_mooncake(wheel_name):
    (build,) = _installed(wheel_name)
    assert (build.distribution, build.host_kind) == WHEEL_NAMES[wheel_name]
    assert build.describe() == f"{WHEEL_NAMES[wheel_name][0]} 0.3.14 ({WHEEL_NAMES[wheel_name][1]})"


def test_an_unknown_distribution_is_named_as_such():
    (build,) = _installed("my-mooncake-source-build")
    assert build.host_kind is None and "not a build this package knows" in build.describe()
    assert _installed() == []


def test_this_environment_has_one_known_build():
    """The venv's own install, read for real (the CPU build here and in CI)."""
    builds = native.installed_mooncake()
    assert len(builds) == 1 and builds[0].host_kind is not None, builds


def test_the_setup_error_names_every_build_when_none_is_installed():
    message = native.mooncake_import_failure(ImportError("No module named 'mooncake'"), [])
    assert "not installed" in message
    for name, kind in WHEEL_NAMES.values():
        assert f"{name} ({kind})" in message
    assert "[cuda13]" in message


def test_the_setup_error_says_a_cuda_build_needs_the_driver():
    """What the CUDA 13 build 0.3.14 raises on a host without the NVIDIA driver."""
    builds = _installed("mooncake_transfer_engine_cuda13")
    failure = ImportError("libcuda.so.1: cannot open shared object file: No such file or directory")
    message = native.mooncake_import_failure(failure, builds)
    assert "does not import (libcuda.so.1" in message
    assert "mooncake-transfer-engine-cuda13 0.3.14 (CUDA 13 hosts)" in message
    assert "NVIDIA driver" in message and "mooncake-transfer-engine-non-cuda instead" in message


def test_the_setup_error_names_builds_installed_over_each_other():
    builds = _installed("mooncake_transfer_engine_non_cuda", "mooncake-transfer-engine")
    message = native.mooncake_import_failure(ImportError("undefined symbol"), builds)
    assert "over each other" in message and "uninstall all of them" in message


def test_load_native_binding_reports_the_installed_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # the import fails
    cuda12 = _installed("mooncake-transfer-engine")
    monkeypatch.setattr(native, "installed_mooncake", lambda: cuda12)
    with pytest.raises(SetupError, match=r"installed: mooncake-transfer-engine 0.3.14 \(CUDA 12"):
        client.load_native_binding()
    monkeypatch.setattr(native, "installed_mooncake", lambda: [])
    with pytest.raises(SetupError, match="not installed.*mooncake-transfer-engine-efa"):
        client.load_native_binding()


def test_doctor_checks_the_build(monkeypatch):
    ctx = Context()
    (check,) = doctor.check_mooncake_build(ctx)
    assert check.status == PASS and "mooncake-transfer-engine" in check.detail
    monkeypatch.setattr(doctor, "installed_mooncake", lambda: [])
    (check,) = doctor.check_mooncake_build(ctx)
    assert check.status == FAIL and "mooncake-transfer-engine-cuda13" in check.fix
    assert "mooncake" in ctx.failed
    two = _installed("mooncake_transfer_engine_cuda13", "mooncake_transfer_engine_efa")
    monkeypatch.setattr(doctor, "installed_mooncake", lambda: two)
    (check,) = doctor.check_mooncake_build(Context())
    assert check.status == WARN and "over each other" in check.detail
    unknown = _installed("mooncake")
    monkeypatch.setattr(doctor, "installed_mooncake", lambda: unknown)
    (check,) = doctor.check_mooncake_build(Context())
    assert check.status == WARN and "not a build this package knows" in check.detail


def test_doctor_fails_a_build_that_does_not_import(monkeypatch):
    cuda13 = _installed("mooncake_transfer_engine_cuda13")
    monkeypatch.setattr(doctor, "installed_mooncake", lambda: cuda13)
    # What the CUDA 13 build 0.3.14 prints on a host without the NVIDIA driver.
    driverless = "raise ImportError('libcuda.so.1: cannot open shared object file')"
    real_run = doctor.subprocess.run
    monkeypatch.setattr(
        doctor.subprocess, "run", lambda argv, **kw: real_run([argv[0], "-c", driverless], **kw)
    )
    ctx = Context()
    (check,) = doctor.check_mooncake_build(ctx)
    assert check.status == FAIL and "does not import (ImportError: libcuda.so.1" in check.detail
    assert "NVIDIA driver" in check.detail and "mooncake" in ctx.failed


def test_the_serving_code_calls_setup_by_name_only():
    """Mooncake 0.3.14 adds ``setup`` parameters: a call by position depends on where
    each wheel puts them. The runtime and the operator commands name every argument
    (the tooling, bench/, lab/ and testing/, is outside the serving package)."""
    package = Path(native.__file__).parents[1]
    positional = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in ("bench", "lab", "testing"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "setup"
                and node.args
            ):
                positional.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not positional, positional
