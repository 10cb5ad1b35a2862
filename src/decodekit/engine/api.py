"""The short Python API: ``Engine(model).generate(prompt, method=..., **params)``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..models import LoadedModel, load_model
from ..samplers import SAMPLER_PARAMS, Sampler
from .core import Generation, Request
from .registry import build_decoder, method_spec


def make_sampler(method: str, params: dict[str, Any]) -> Sampler:
    """The sampler for a request: greedy for every method except ``sample``, unless a positive
    temperature is given (then speculative methods verify by speculative sampling)."""
    params = dict(params)
    if method == "greedy":
        params["greedy"] = True
        params.pop("temperature", None)
    elif method != "sample" and params.get("temperature") is None:
        params["greedy"] = True
    params = {k: v for k, v in params.items() if v is not None}
    return Sampler.from_params(**params)


def split_params(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split keyword arguments into sampler parameters and method options."""
    sampler = {k: v for k, v in params.items() if k in SAMPLER_PARAMS}
    options = {k: v for k, v in params.items() if k not in SAMPLER_PARAMS}
    return sampler, options


class Engine:
    """A loaded model plus the methods that decode with it. Reuse it across requests."""

    def __init__(self, model: str | LoadedModel | None = None, *, backend: str = "auto", dtype: str | torch.dtype = "float32"):
        self.model = model if isinstance(model, LoadedModel) else load_model(model, backend=backend, dtype=dtype)

    def generate(
        self,
        prompt: str | list[dict[str, str]] | list[int],
        *,
        method: str = "greedy",
        max_new_tokens: int = 256,
        stop: str | Sequence[str] = (),
        chat: bool = True,
        on_text: Callable[[str], None] | None = None,
        **params: Any,
    ) -> Generation:
        """Generate a continuation. ``params`` are sampler parameters (temperature, top_p, seed, ...)
        and method options (e.g. ``max_ngram`` for ``pld``); unknown names raise an error."""
        from ..errors import InvalidParameter

        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidParameter(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        method_spec(method)  # unknown method: fail before any work
        sampler_params, options = split_params(params)
        decoder = build_decoder(method, **options)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            prompt_ids = self.model.prompt_ids(prompt, chat=chat)
        request = Request(prompt_ids, make_sampler(method, sampler_params), max_new_tokens, stop, on_text)
        # One request at a time per backend: threads sharing an Engine (or its model) queue here.
        with self.model.backend.lock:
            return decoder.generate(self.model, request)


_default_engines: dict[tuple, Engine] = {}
_default_engines_lock = threading.Lock()


def generate(prompt: str | list[dict[str, str]], *, model: str | None = None, dtype: str = "float32", **kwargs: Any) -> Generation:
    """One-call generation; the model is loaded once per (model, dtype) and reused."""
    key = (model, dtype)
    with _default_engines_lock:  # two threads' first calls load the model once
        if key not in _default_engines:
            _default_engines[key] = Engine(model, dtype=dtype)
        engine = _default_engines[key]
    return engine.generate(prompt, **kwargs)
