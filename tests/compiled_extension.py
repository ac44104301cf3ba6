"""Tests that need the `overlap._C` extension: where this machine has a C++ compiler, the
extension should have been built (`make setup`), so a missing one is a failed build and the
test fails saying so; only where no compiler exists is the test skipped.

[Note: why not importorskip]
`setup.py` builds the extension optionally: a build that fails only warns and installs the
pure-Python package. `pytest.importorskip("overlap._C")` then turned every extension test into
a skip, and a broken build passed the suite.

Use `require_extension()` inside a test, or the mark `needs_extension` (which needs the
fixture imported into the test module: `from compiled_extension import compiled_extension`).
"""
from __future__ import annotations

import importlib
import shutil
from typing import Optional

import pytest

# The compiler names torch.utils.cpp_extension and setuptools look for on Linux and macOS.
COMPILER_NAMES = ("c++", "g++", "clang++")


def cxx_compiler() -> Optional[str]:
    """The first C++ compiler on PATH, or None."""
    return next((path for path in map(shutil.which, COMPILER_NAMES) if path is not None), None)


def extension_built() -> bool:
    try:
        importlib.import_module("overlap._C")
    except ImportError:
        return False
    return True


def require_extension() -> None:
    """Return where `overlap._C` imports; skip where no C++ compiler could have built it; fail
    where one could have."""
    if extension_built():
        return
    compiler = cxx_compiler()
    if compiler is None:
        pytest.skip(f"overlap._C is not built and no C++ compiler ({', '.join(COMPILER_NAMES)}) is on PATH")
    pytest.fail(f"overlap._C is not built although {compiler} is here: the extension's build failed "
                "(`pip install -e .` prints why)")


@pytest.fixture
def compiled_extension() -> None:
    require_extension()


needs_extension = pytest.mark.usefixtures("compiled_extension")
