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

from typing import TYPE_CHECKING

from .exports import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, subpackages=True)
