"""Model backends: the one place that touches caches, attention masks and hidden states."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import PromptTooLong
from .backend import Backend, ModelInfo, StepOutput
from .cache import EntryRemoved, reading
from .chat_template import refusals_as_invalid
from .loading import (DEFAULT_MODEL, EMBEDDED_MODELS, build_backend, check_backend, parse_dtype, refuse_kv_policy,
                      resolve_model)
from .kv_policy import KVPolicy, parse_kv_cache
from .memory import return_freed_memory
from .tokenizer import CharTokenizer, HFTokenizer, ShieldedMessages, Tokenizer, file_tokenizer


@dataclass
class LoadedModel:
    """A backend with its tokenizer: what the engine, the CLI and the benchmarks pass around."""

    backend: Backend
    tokenizer: Tokenizer
    name: str

    def prompt_ids(self, prompt: str | list[dict[str, str]], *, chat: bool = True) -> list[int]:
        """Token ids of a prompt; a chat template is applied when the model has one and ``chat`` (one
        that refuses the messages raises InvalidParameter); the ids start with the tokenizer's
        prompt prefix (e.g. a BOS token) when the text does not. A message's special-token text is
        read as plain text (:class:`.tokenizer.ShieldedMessages`); a prompt string read without the
        template (``chat`` false: a raw completion prompt) keeps its special tokens."""
        raw = isinstance(prompt, str) and not chat
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        shielded = ShieldedMessages(self.tokenizer, [] if raw else messages)
        with refusals_as_invalid():  # roles the template does not take: the caller's mistake
            text = self.tokenizer.chat_prompt(shielded.messages) if chat else None
        if text is None:
            text = prompt if raw else "\n".join(m["content"] for m in shielded.messages)
        info = self.backend.info
        fewest = self.tokenizer.surely_more_tokens(shielded.unmarked(text), info.max_length)
        if fewest is not None:  # refused before tokenising it: that would take a while
            raise PromptTooLong(f"prompt of {len(text)} characters, at least {fewest} tokens, exceeds {info.length_limit()}")
        ids, prefix = shielded.encode(text), list(self.tokenizer.prompt_prefix)
        return ids if ids[: len(prefix)] == prefix else prefix + ids


def load_model(
    model: str | None = None, *, backend: str = "auto", dtype: str | torch.dtype = "float32", numerics: str = "exact",
    kv_cache: "str | KVPolicy" = "full",
) -> LoadedModel:
    """Load a model by embedded name, Hugging Face folder or GGUF path (default: SmolLM2-135M),
    computing in ``numerics`` (``exact`` or ``fast``, see :data:`..arguments.NUMERICS`), keeping the
    keys and values ``kv_cache`` says (:mod:`.kv_policy`: ``full``, ``sink:S,window:W``, ...)."""
    policy = parse_kv_cache(kv_cache)  # a bad spelling fails before any loading
    check_backend(backend)
    parse_dtype(dtype)
    name = model or DEFAULT_MODEL
    folder, gguf = resolve_model(model, check=lambda file: refuse_kv_policy(file, policy))

    def weights(folder: Path) -> Backend:
        return build_backend(folder, backend=backend, dtype=parse_dtype(dtype), gguf=gguf, numerics=numerics,
                             kv_cache=policy)

    if gguf is None:  # a Hugging Face folder: its config and weights are checked first, each with its own message
        return LoadedModel(backend=weights(folder), tokenizer=HFTokenizer(folder), name=name)
    # A folder decodekit wrote from the GGUF file, read under its shared lock (a `decodekit cache
    # --prune` meanwhile leaves it; one that pruned it between its check and the lock: checked, so
    # built, again): the tokenizer first. Parsing a big one (Gemma's 262k tokens) frees most of what
    # it takes, which goes back to the system before the weights arrive, so the peaks do not add up.
    def read(folder: Path) -> LoadedModel:
        with reading(folder):
            tokenizer = file_tokenizer(folder)
            return_freed_memory()
            return LoadedModel(backend=weights(folder), tokenizer=tokenizer, name=name)

    try:
        return read(folder)
    except EntryRemoved:
        return read(resolve_model(model)[0])


__all__ = [
    "Backend",
    "CharTokenizer",
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "LoadedModel",
    "ModelInfo",
    "StepOutput",
    "Tokenizer",
    "load_model",
]
