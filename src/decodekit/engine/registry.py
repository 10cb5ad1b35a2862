"""Method names → decoders. Plain decoding registers here; the packages that declare other methods
register them when imported, and the registry imports them at its first lookup: decodekit's own
(``decodekit.METHOD_PACKAGES``: speculative and search; so the engine never names a layer above it),
then any installed package's own methods, declared as a ``decodekit.methods`` entry point::

    [project.entry-points."decodekit.methods"]
    mymethods = "mypackage.decoding"    # a module that calls register_method(...)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any, Literal

from ..errors import DecodeKitError, InvalidParameter, UnknownMethod, cause_line
from ..models.kv_policy import parse_kv_cache
from ..options import OptionSpec, parse_options
from ..samplers.params import SAMPLER_OPTIONS
from .core import Decoder, PlainDecoding, StepDecoder

#: When a method's requests sample: "never" (greedy even with a temperature: giving one is an
#: error), "always" (``sample``), or "when-temperature" (greedy unless a temperature is given;
#: speculative methods then verify by speculative sampling, search methods sample their candidates).
Sampling = Literal["never", "always", "when-temperature"]


#: What a method is: plain decoding, draft and verify (lossless), or a search over whole answers.
FAMILIES = ("plain", "speculative", "search")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    build: Callable[..., Decoder]  # keyword options (checked against ``options``) -> Decoder
    description: str
    lossless: bool  # True: output identical to plain decoding with the same sampler
    family: str  # one of FAMILIES
    # The method's options; None: not declared (the builder checks what it is given).
    options: Mapping[str, OptionSpec] | None = field(default=None)
    sampling: Sampling = "when-temperature"


_METHODS: dict[str, MethodSpec] = {}
PLUGIN_GROUP = "decodekit.methods"
_plugins_imported = False  # every package that registers methods imported
_built_ins_imported = False
_plugins_importing = False  # under way, on the thread that holds _loading
#: The first lookups: other threads wait here until the imports are done (they saw a half-filled
#: registry); the importing thread may come back in (a package that looks a method up as it registers).
_loading = threading.RLock()


def _import_built_ins() -> None:
    """decodekit's own method packages, imported once (before any other package's methods, so that
    none can take a built-in method's name by registering first)."""
    global _built_ins_imported
    with _loading:
        if not _built_ins_imported:
            from .. import METHOD_PACKAGES

            _built_ins_imported = True  # before the imports: a package registers as it is imported
            for package in METHOD_PACKAGES:
                import_module(package)


def _registered() -> dict[str, MethodSpec]:
    """The registry, with the packages that register methods imported first (once)."""
    global _plugins_imported, _plugins_importing
    if _plugins_imported:
        return _METHODS
    with _loading:
        if _plugins_imported or _plugins_importing:  # done meanwhile, or this thread's own imports looking one up
            return _METHODS
        _plugins_importing = True
        try:
            _import_built_ins()
            for point in entry_points(group=PLUGIN_GROUP):
                try:
                    point.load()
                except Exception as err:  # another package's bug or missing dependency: one line, naming it
                    # (tried again at the next lookup, so no lookup sees a partial registry)
                    raise DecodeKitError(f"the methods of {point.value!r} ({PLUGIN_GROUP} entry point {point.name!r}) "
                                         f"could not be imported: {cause_line(err)}") from None
            _plugins_imported = True
        finally:
            _plugins_importing = False
    return _METHODS


def register_method(name: str, build: Callable[..., Decoder], description: str, *, lossless: bool, family: str,
                    options: Mapping[str, OptionSpec] | None = None, sampling: Sampling = "when-temperature") -> None:
    """Add a method. A name another module registered is refused: an installed package must not
    replace a built-in method (a ``pld`` whose output differs) without anyone asking for it. The same
    module registering again (its import retried after a failure) replaces its own entry."""
    # a plugin's mistake is refused here, in one line, not later in every user's request
    if not isinstance(name, str) or not name.strip():
        raise InvalidParameter(f"a method's name must be a non-empty string, got {name!r:.80}")
    if not callable(build):
        raise InvalidParameter(f"method {name!r}: build must be callable (it returns the decoder), got {build!r:.80}")
    if not isinstance(description, str):
        raise InvalidParameter(f"method {name!r}: description must be a string, got {description!r:.80}")
    if not isinstance(lossless, bool):
        raise InvalidParameter(f"method {name!r}: lossless must be True or False, got {lossless!r:.80}")
    if family not in FAMILIES:
        raise InvalidParameter(f"method {name!r}: family must be one of {', '.join(FAMILIES)}, got {family!r:.80}")
    if sampling not in ("never", "always", "when-temperature"):
        raise InvalidParameter(f"sampling must be never, always or when-temperature, got {sampling!r}")
    clash = sorted(set(options or ()) & set(SAMPLER_OPTIONS))
    if clash:  # a keyword of that name always goes to the sampler: the option could never be set
        raise InvalidParameter(f"method {name!r}: option(s) {', '.join(clash)} share a name with the sampler's "
                               "parameters; choose other names")
    if not _module_of(build).startswith("decodekit."):  # another package's method: after the built-in ones
        _import_built_ins()
    existing = _METHODS.get(name)
    if existing is not None and _module_of(existing.build) != _module_of(build):
        raise InvalidParameter(f"method {name!r} is registered already, by {_module_of(existing.build)}; choose another name")
    _METHODS[name] = MethodSpec(name, build, description, lossless, family, options, sampling)


def _module_of(build: Callable[..., Decoder]) -> str:
    """The module that defined a builder (a partial's function's)."""
    return getattr(getattr(build, "func", build), "__module__", "?")


def available_methods() -> dict[str, MethodSpec]:
    return dict(_registered())


def method_spec(name: str) -> MethodSpec:
    methods = _registered()
    if not isinstance(name, str) or name not in methods:
        raise UnknownMethod(f"unknown method {name!r}; choose from: {', '.join(sorted(methods))}", param="method")
    return methods[name]


def validate_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` for method ``name`` with each value parsed and checked (text from the command
    line is accepted); an unknown name or a bad value raises InvalidParameter naming it."""
    spec = method_spec(name)
    if spec.options is None:
        return dict(options)
    return parse_options(f"method {name!r}", spec.options, options, defaults=False)


#: The options that size a search: its candidates, and the children each of them expands into.
WIDTH_OPTIONS = ("n", "expand")


def search_widths(name: str, options: Mapping[str, Any]) -> dict[str, int]:
    """A search's :data:`WIDTH_OPTIONS` as ``options`` set them (defaults included); empty for every
    other family."""
    spec = method_spec(name)
    if spec.family != "search" or not spec.options:
        return {}
    checked = validate_options(name, options)
    return {key: checked.get(key, spec.options[key].default) for key in WIDTH_OPTIONS if key in spec.options}


def sequences_at_once(name: str, options: Mapping[str, Any]) -> int:
    """How many sequences method ``name`` with ``options`` decodes at once, each a row of its cache in
    every pass: a search's ``expand`` where it has one (step-beam expands its beams one after
    another), else its ``n``; 1 for every other family."""
    widths = search_widths(name, options)
    return widths.get("expand", widths.get("n", 1))


def check_model_cache(name: str, options: Mapping[str, Any], decoder: Decoder, kv_cache: str) -> None:
    """Refuse, before the model loads, a model cache (a ``--kv-cache`` spelling) that method ``name``
    with ``options``, built as ``decoder``, cannot decode under: a search's sequences at once where
    the cache holds one (a search under int8), or what the decoder itself refuses (kvdraft under a
    cache it cannot draft for, :meth:`Decoder.check_kv_cache`)."""
    policy = parse_kv_cache(kv_cache)
    policy.check_sequences(sequences_at_once(name, options))
    decoder.check_kv_cache(policy)


def build_decoder(name: str, /, **options: Any) -> Decoder:
    """Method ``name``'s decoder with ``options`` checked (``name`` is positional only: an option
    may be called ``name`` too, and is then checked as any other)."""
    spec = method_spec(name)
    decoder = spec.build(**validate_options(name, options))
    if not isinstance(decoder, Decoder):  # a plugin's build, which register_method can only call later
        raise InvalidParameter(f"method {name!r}: its build ({_module_of(spec.build)}) returned {type(decoder).__name__}, "
                               "not a decodekit Decoder")
    return decoder


def plain_decoder() -> Decoder:
    return StepDecoder(PlainDecoding())


register_method("greedy", plain_decoder, "plain greedy decoding", lossless=True, family="plain", options={}, sampling="never")
register_method("sample", plain_decoder, "plain sampling with the sampler options (temperature, top-p, ...)",
                lossless=True, family="plain", options={}, sampling="always")
