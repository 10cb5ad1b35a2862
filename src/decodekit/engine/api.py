"""The short Python API: ``Engine(model).generate(prompt, method=..., **params)``."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from numbers import Integral
from typing import Any

import torch

from ..errors import InvalidParameter
from ..models import DEFAULT_MODEL, LoadedModel, load_model, parse_dtype
from ..models.backend import Backend, Interrupted
from ..models.kv_policy import parse_kv_cache
from ..options import check_int
from ..samplers import SAMPLER_OPTIONS, LogitsProcessor, Sampler
from ..samplers.sampler import truncation_asked
from ..samplers.constraint import Constraint, constraint_processor
from .core import Generation, Request, stop_requested
from .registry import build_decoder, method_spec


def make_sampler(method: str, params: Mapping[str, Any], constraint: LogitsProcessor | None = None) -> Sampler:
    """The sampler for a request. Every value is checked, whatever the method; then the method's
    ``sampling`` decides: "always" samples, "when-temperature" samples only when a temperature is
    given, "never" decodes greedily and refuses a positive temperature. Plain greedy decoding, and a
    speculative method decoding greedily, refuse truncation samplers too (``top_p``, ``top_k``, ...):
    they take the most likely token, so those would be ignored (a search's greedy paths do read
    them: CoT-decoding branches on the first tokens they leave). An explicit temperature of 0 is
    greedy decoding as OpenAI's API defines it, with no refusal: its clients send ``top_p`` with every
    request. ``constraint`` (a compiled
    structured-output mask) runs before every other processor."""
    params = {k: v for k, v in params.items() if v is not None}
    spec = method_spec(method)
    sampling = spec.sampling
    temperature = params.get("temperature")
    if "greedy" in params:  # checked before a method that decides it sets it
        SAMPLER_OPTIONS["greedy"].check(params["greedy"])
    why = f"method {method!r} never samples"
    remedy = "use method 'sample' (or a speculative or search method) to sample"
    if sampling == "never":
        if temperature is not None and SAMPLER_OPTIONS["temperature"].check(temperature) > 0:
            raise InvalidParameter(f"{why}, so temperature={temperature:g} would be ignored; {remedy}")
        params["greedy"] = True
    elif sampling == "when-temperature" and temperature is None:
        params["greedy"] = True
        why, remedy = f"method {method!r} samples only with a temperature", "give one to sample"
    sampler = Sampler.from_params(**params)
    asked = truncation_asked(params) if params.get("greedy") and spec.lossless else {}
    if asked:
        name, value = next(iter(asked.items()))
        raise InvalidParameter(f"{why}, so {name}={value:g} would be ignored; {remedy}", param=name)
    if constraint is None:
        return sampler
    return Sampler([constraint, *sampler.processors], greedy=sampler.is_greedy, seed=sampler.seed)


def split_params(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split keyword arguments into sampler parameters and method options."""
    sampler = {k: v for k, v in params.items() if k in SAMPLER_OPTIONS}
    options = {k: v for k, v in params.items() if k not in SAMPLER_OPTIONS}
    return sampler, options


def check_text(text: str, what: str, param: str | None = None) -> str:
    """``text`` if it can be encoded (a lone surrogate, e.g. from undecodable bytes, cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidParameter(f"{what} is not valid UTF-8 text (undecodable character at position {err.start})",
                               param=param) from None
    return text


def check_prompt_text(text: str, what: str = "the prompt") -> str:
    """``text`` as a prompt, refused where it is empty or only whitespace: the same check for the
    CLI's prompt and the API's (a prompt of token ids is not text, and is not asked)."""
    if not text.strip():
        raise InvalidParameter(f"{what} is empty", param="prompt")
    return text


#: The roles a chat message may have: OpenAI's ("developer" is its newer name for "system").
CHAT_ROLES = ("system", "developer", "user", "assistant")


def chat_role(role: Any, where: str) -> str:
    """A chat message's role as chat templates know it (a developer message is a system one). Any
    other is refused in one line, here for the Python API and the server alike: a template would
    render it as a turn the model was never trained on."""
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise InvalidParameter(f"{where} must have a role, one of {', '.join(CHAT_ROLES)}; got {role!r:.80}",
                               param="prompt")
    return "system" if role == "developer" else role


def prompt_token_ids(model: LoadedModel, prompt: Any, *, chat: bool) -> list[int]:
    """The token ids of a prompt (a string, a list of chat messages or a list of token ids);
    anything else, an empty prompt or a token id outside the vocabulary raises InvalidParameter."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
        vocab = model.backend.info.vocab_size
        bad = next((int(t) for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameter(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        return [int(t) for t in prompt]
    if isinstance(prompt, str):
        ids = model.prompt_ids(check_text(check_prompt_text(prompt), "the prompt", "prompt"), chat=chat)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping) for m in prompt):
        messages = []
        for i, message in enumerate(prompt):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise InvalidParameter(f"prompt message {i} needs a 'role' and a 'content' string, got {message!r}",
                                       param="prompt")
            check_text(message["content"], f"prompt message {i}", "prompt")
            messages.append({**message, "role": chat_role(message["role"], f"prompt message {i}")})
        ids = model.prompt_ids(messages, chat=chat)
    elif isinstance(prompt, (list, tuple)) and not prompt:
        raise InvalidParameter("the prompt is empty", param="prompt")
    else:
        raise InvalidParameter("the prompt must be a string, a list of {'role', 'content'} messages or a list of "
                               f"token ids, got {prompt!r:.80}", param="prompt")
    if not ids:
        raise InvalidParameter("the prompt is empty", param="prompt")
    return ids


class Engine:
    """A loaded model plus the methods that decode with it. Reuse it across requests."""

    def __init__(
        self, model: str | LoadedModel | None = None, *, backend: str | None = None, dtype: str | torch.dtype | None = None,
        numerics: str | None = None, kv_cache: str | None = None,
    ):
        """``backend``, ``dtype``, ``numerics`` and ``kv_cache`` choose how a model named (or the
        default one) is loaded, as :func:`load_model`'s arguments (its defaults where not given); a
        :class:`LoadedModel` keeps what it was loaded with, and they are refused beside one rather
        than ignored."""
        given = {name: value for name, value in (("backend", backend), ("dtype", dtype), ("numerics", numerics),
                                                 ("kv_cache", kv_cache)) if value is not None}
        if isinstance(model, LoadedModel):
            if given:
                raise InvalidParameter(f"{', '.join(given)}: chosen when a model is loaded; this one is loaded already "
                                       f"(pass them to load_model, or give the model's name here)", param=next(iter(given)))
            self.model = model
        else:
            self.model = load_model(model, **given)

    def generate(
        self,
        prompt: str | list[dict[str, str]] | list[int],
        *,
        method: str = "greedy",
        max_new_tokens: int = 256,
        stop: str | Sequence[str] = (),
        chat: bool = True,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        ignore_eos: bool = False,
        constraint: Constraint | dict | None = None,
        **params: Any,
    ) -> Generation:
        """Generate a continuation. ``params`` are sampler parameters (temperature, top_p, seed, ...)
        and method options (e.g. ``max_ngram`` for ``pld``); unknown names raise an error.
        ``should_stop`` is asked before the request starts, between the passes of a long prompt and
        after every step; when it says True the generation ends there (finish reason ``cancelled``:
        a client went away, a deadline passed; before the first step, with no text). ``ignore_eos`` decodes
        past end-of-sequence tokens (for fixed-length benchmarks), except where a ``constraint``'s
        grammar ends the text. ``constraint`` (a
        :class:`..samplers.constraint.Constraint`, or a dict such as ``{"json_schema": {...}}``,
        ``{"regex": "..."}``, ``{"choice": [...]}``) makes the output match it, with any method."""
        check_int("max_new_tokens", max_new_tokens)
        if on_text is not None and not callable(on_text):
            raise InvalidParameter(f"on_text must be a callable taking the new text, got {on_text!r}")
        if should_stop is not None and not callable(should_stop):
            raise InvalidParameter(f"should_stop must be a callable answering True to end the request, got {should_stop!r}")
        for name, flag in (("chat", chat), ("ignore_eos", ignore_eos)):
            if not isinstance(flag, bool):
                raise InvalidParameter(f"{name} must be true or false, got {flag!r}")
        if ignore_eos and method_spec(method).family == "search":  # (an unknown method fails before any work)
            raise InvalidParameter(f"ignore_eos is for plain and speculative decoding; {method} chooses among candidates "
                                   "that end where the model ends them", param="ignore_eos")
        sampler_params, options = split_params(params)
        refuse_loading_choices(method, options)
        decoder = build_decoder(method, **options)
        mask = None
        if constraint is not None:
            mask = constraint_processor(constraint, self.model.tokenizer)
        sampler = make_sampler(method, sampler_params, mask)
        request = Request(prompt_token_ids(self.model, prompt, chat=chat), sampler, max_new_tokens, stop, on_text,
                          should_stop, ignore_eos)
        # One request at a time per backend: threads sharing an Engine (or its model) queue here.
        backend = self.model.backend
        with backend.lock:
            if backend.request_thread == threading.get_ident():  # the lock lets its own thread in again
                raise InvalidParameter("generate() was called on a model whose generation on this thread is still running "
                                       "(from its on_text or should_stop?): it would overwrite that one's cache; call it "
                                       "once that one has returned, or on a clone of the model")
            backend.request_thread, backend.interrupt = threading.get_ident(), should_stop
            try:
                # cancelled before it started (a client gone while it waited): no pass at all
                generation = Generation.cancelled() if stop_requested(request) else decoder.generate(self.model, request)
            except Interrupted:  # a search stopped by should_stop (Cancelled), or its prompt's reading: no answer yet
                generation = Generation.cancelled()
            finally:
                backend.request_thread = backend.interrupt = None
            keep_answer(backend, method, request.prompt_ids, generation)
        if on_text is not None and not decoder.streams and generation.text:
            on_text(generation.text)
        return generation


#: load_model's defaults for the loading choices generate() leaves out (one cache key for either spelling).
LOAD_DEFAULTS = {name: p.default for name, p in inspect.signature(load_model).parameters.items() if p.kind is p.KEYWORD_ONLY}
_default_engines: dict[tuple, Engine] = {}
_default_engines_lock = threading.Lock()


def refuse_loading_choices(method: str, options: Mapping[str, Any]) -> None:
    """A loading choice (kv_cache, numerics, dtype, backend, model) given to ``Engine.generate``
    is refused in one line that says where it goes, rather than as an option the method lacks."""
    misplaced = [name for name in ("model", *LOAD_DEFAULTS) if name in options and name not in method_spec(method).options]
    if misplaced:
        raise InvalidParameter(f"{', '.join(misplaced)}: chosen when a model is loaded; pass "
                               f"{'it' if len(misplaced) == 1 else 'them'} to Engine(...) or decodekit.generate(...), "
                               "not to Engine.generate()", param=misplaced[0])


def keep_answer(backend: Backend, method: str, prompt_ids: list[int], generation: Generation) -> None:
    """Note what the cache holds after a request, for a next prompt that starts the same way (a
    chat's next turn reads only its new part): the prompt and the answer after plain or speculative
    decoding; after a search, whatever candidate, particle or judge's question it read last, and
    after a cancelled request, perhaps part of its prompt, so nothing is kept."""
    if backend.batch_size == 1 and generation.finish_reason != "cancelled" and method_spec(method).family != "search":
        backend.keep(prompt_ids + generation.tokens)


def generate(
    prompt: str | list[dict[str, str]], *, model: str | LoadedModel | None = None, backend: str | None = None,
    dtype: str | None = None, numerics: str | None = None, kv_cache: str | None = None, **kwargs: Any,
) -> Generation:
    """One-call generation; the model is loaded once per (model, backend, dtype, numerics, kv_cache)
    and reused (those not given: :func:`load_model`'s defaults), or ``model`` is one loaded already."""
    if isinstance(model, LoadedModel):
        return Engine(model, backend=backend, dtype=dtype, numerics=numerics, kv_cache=kv_cache).generate(prompt, **kwargs)
    given = {"backend": backend, "dtype": dtype, "numerics": numerics, "kv_cache": kv_cache}
    chosen = {name: LOAD_DEFAULTS[name] if value is None else value for name, value in given.items()}
    # one key however a choice is spelt (the default model named or not, " full" or "full"): each
    # model loaded stays loaded
    key = (DEFAULT_MODEL if model is None else model, chosen["backend"], parse_dtype(chosen["dtype"]), chosen["numerics"],
           parse_kv_cache(chosen["kv_cache"]).spec)
    try:
        hash(key)
    except TypeError:  # a list or a dict where a name goes
        raise InvalidParameter("model, backend, dtype, numerics and kv_cache are names (strings), got "
                               f"{key!r:.120}") from None
    with _default_engines_lock:  # two threads' first calls load the model once
        if key not in _default_engines:
            _default_engines[key] = Engine(model, backend=backend, dtype=dtype, numerics=numerics, kv_cache=kv_cache)
        engine = _default_engines[key]
    return engine.generate(prompt, **kwargs)
