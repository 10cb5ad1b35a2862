"""Method names → decoders. Plug-in packages (speculative, search) register themselves here."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InvalidParameter, UnknownMethod
from .core import Decoder, PlainDecoding, StepDecoder

# Packages whose import registers more methods. Imported lazily, on first lookup.
PLUGIN_MODULES = ("decodekit.speculative", "decodekit.search")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    build: Callable[..., Decoder]  # keyword options -> Decoder; raises InvalidParameter on bad options
    description: str
    lossless: bool  # True: output identical to plain decoding with the same sampler
    family: str  # "plain" | "speculative" | "search"


_METHODS: dict[str, MethodSpec] = {}
_plugins_loaded = False


def register_method(name: str, build: Callable[..., Decoder], description: str, *, lossless: bool, family: str) -> None:
    _METHODS[name] = MethodSpec(name, build, description, lossless, family)


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for module in PLUGIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:  # a real import error inside the plug-in
                raise


def available_methods() -> dict[str, MethodSpec]:
    _load_plugins()
    return dict(_METHODS)


def method_spec(name: str) -> MethodSpec:
    methods = available_methods()
    if name not in methods:
        raise UnknownMethod(f"unknown method {name!r}; choose from: {', '.join(sorted(methods))}")
    return methods[name]


def build_decoder(name: str, **options) -> Decoder:
    return method_spec(name).build(**options)


def no_options(factory: Callable[[], Decoder], name: str) -> Callable[..., Decoder]:
    """A builder for a method that takes no options (rejects any it is given)."""

    def build(**options) -> Decoder:
        if options:
            raise InvalidParameter(f"method {name!r} takes no options, got: {', '.join(sorted(options))}")
        return factory()

    return build


register_method(
    "greedy", no_options(lambda: StepDecoder(PlainDecoding()), "greedy"), "plain greedy decoding", lossless=True, family="plain"
)
register_method(
    "sample",
    no_options(lambda: StepDecoder(PlainDecoding()), "sample"),
    "plain sampling with the sampler options (temperature, top-p, ...)",
    lossless=True,
    family="plain",
)
