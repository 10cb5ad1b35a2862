"""decodekit: the decoding layer for language models.

    >>> import decodekit
    >>> decodekit.generate("What is the capital of France?").text
    >>> engine = decodekit.Engine()            # load once, reuse
    >>> engine.generate("Hi", method="pld", max_new_tokens=64)
"""

from .engine import Engine, Generation, available_methods, generate
from .errors import DecodeKitError
from .models import load_model
from .samplers import Sampler

# The engine registers plain decoding; these packages register their methods when imported.
from . import search, speculative  # noqa: E402,F401  (after the engine: they build on it)

__version__ = "0.1.0"
__all__ = ["DecodeKitError", "Engine", "Generation", "Sampler", "available_methods", "generate", "load_model"]
