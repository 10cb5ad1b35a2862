"""A package's public names imported from their submodules on first use (PEP 562), so that importing
the package, or a light submodule of it, does not import what the others need (torch above all):
``decodekit --help`` and a mistyped flag answer at once.

    _EXPORTS = {"Sampler": ".sampler", ...}
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str], *,
                 subpackages: bool = False) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each name of ``exports`` comes from the
    submodule it maps to (relative to the package), imported at the name's first lookup; with
    ``subpackages``, any other name is a subpackage not imported yet, as an eager package has it."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(import_module(exports[name], package), name)
        elif subpackages:
            try:
                value = import_module(f".{name}", package)
            except ModuleNotFoundError as err:
                if err.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
