"""decodekit: the decoding layer for language models.

    >>> import decodekit
    >>> decodekit.generate("What is the capital of France?").text
    >>> engine = decodekit.Engine()            # load once, reuse
    >>> engine.generate("Hi", method="pld", max_new_tokens=64)

The names below are imported on first use (PEP 562), so ``import decodekit`` and its light
submodules (``decodekit.cluster``, ``decodekit.errors``, the command line's argument checks) do not
import torch: a Ray worker whose payload needs no model starts without it, and a command refused
for a bad flag answers before torch has loaded. The engine, once imported, imports the speculative
and search packages, which register their methods.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Each public name and the submodule it comes from.
_EXPORTS = {
    "DecodeKitError": ".errors",
    "Engine": ".engine", "Generation": ".engine", "available_methods": ".engine", "generate": ".engine",
    "load_model": ".models",
    "Sampler": ".samplers",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .engine import Engine, Generation, available_methods, generate
    from .errors import DecodeKitError
    from .models import load_model
    from .samplers import Sampler


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'decodekit' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
