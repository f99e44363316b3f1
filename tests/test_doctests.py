"""Every docstring example in the packages runs and gives what it shows (they are the pure
functions' documentation: an example that no longer holds misleads)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ("shared", "extract", "train")


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            if not info.name.endswith(".__main__"):
                names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
