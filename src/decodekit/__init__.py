"""decodekit: the decoding layer for language models.

    >>> import decodekit
    >>> decodekit.generate("What is the capital of France?").text
    >>> engine = decodekit.Engine()            # load once, reuse
    >>> engine.generate("Hi", method="pld", max_new_tokens=64)

The names below are imported on first use (PEP 562), so ``import decodekit`` and its light
submodules (``decodekit.cluster``, ``decodekit.errors``) do not import torch: a Ray worker whose
payload needs no model starts without it.
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

#: The packages whose import registers decoding methods: the method registry imports them at its
#: first lookup (named here, at the top, so the engine never names a layer above it), then those of
#: other installed packages, which declare themselves under the ``decodekit.methods`` entry points.
METHOD_PACKAGES = ("decodekit.speculative", "decodekit.search")

if TYPE_CHECKING:
    from .engine import Engine, Generation, available_methods, generate
    from .errors import DecodeKitError
    from .models import load_model
    from .samplers import Sampler


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
    else:  # a subpackage not imported yet (``decodekit.speculative``), as an eager package would have it
        try:
            value = import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'decodekit' has no attribute {name!r}") from None
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
