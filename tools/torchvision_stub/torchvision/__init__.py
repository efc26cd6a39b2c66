"""Import-only torchvision stand-in for CPU-only development machines.

sglang 0.5.23 imports ``torchvision.transforms`` while loading its memory-pool
modules, and transformers probes for torchvision with ``find_spec``. PyPI only
serves CUDA builds of torchvision, which fail to load next to CPU torch, so the
development venv gets this package instead. HiCache never calls torchvision:
every attribute resolves to a placeholder that raises when it is used. The two
enums transformers keys dictionaries on are real.

``scripts/setup.sh`` installs it only where no working torchvision exists; it
is never a dependency of mooncake-span.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+mooncake-span-stub"
IS_STUB = True


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


_ENUMS = {"InterpolationMode": InterpolationMode, "ImageReadMode": ImageReadMode}


class _Missing:
    """Stands for any torchvision object; using it says why it is not there."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(
            f"{self._qualname} is unavailable: this venv has an import-only "
            "torchvision stand-in (CPU-only machine)"
        )

    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __mro_entries__(self, bases: tuple) -> tuple:
        # Lets `class X(torchvision.something.Base)` at import time still work.
        return (object,)


def _module_getattr(module_name: str):
    def __getattr__(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _ENUMS:
            return _ENUMS[name]
        return sys.modules.get(f"{module_name}.{name}") or _Missing(f"{module_name}.{name}")

    return __getattr__


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__getattr__ = _module_getattr(module.__name__)  # type: ignore[attr-defined]


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())

__getattr__ = _module_getattr(__name__)
