"""Model backends: the one place that touches caches, attention masks and hidden states."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import Backend, ModelInfo, StepOutput
from .loading import DEFAULT_MODEL, EMBEDDED_MODELS, build_backend, model_gguf, parse_dtype, resolve_model_folder
from .kv_policy import KVPolicy, parse_kv_cache
from .tokenizer import CharTokenizer, HFTokenizer, Tokenizer


@dataclass
class LoadedModel:
    """A backend with its tokenizer: what the engine, the CLI and the benchmarks pass around."""

    backend: Backend
    tokenizer: Tokenizer
    name: str

    def prompt_ids(self, prompt: str | list[dict[str, str]], *, chat: bool = True) -> list[int]:
        """Token ids of a prompt; a chat template is applied when the model has one and ``chat``;
        the ids start with the tokenizer's prompt prefix (e.g. a BOS token) when the text does not."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = self.tokenizer.chat_prompt(messages) if chat else None
        if text is None:
            text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)
        ids, prefix = self.tokenizer.encode(text), list(self.tokenizer.prompt_prefix)
        return ids if ids[: len(prefix)] == prefix else prefix + ids


def load_model(
    model: str | None = None, *, backend: str = "auto", dtype: str | torch.dtype = "float32", numerics: str = "exact",
    kv_cache: "str | KVPolicy" = "full",
) -> LoadedModel:
    """Load a model by embedded name, Hugging Face folder or GGUF path (default: SmolLM2-135M),
    computing in ``numerics`` (``exact`` or ``fast``, see :data:`.native.NUMERICS`), keeping the
    keys and values ``kv_cache`` says (:mod:`.kv_policy`: ``full``, ``sink:S,window:W``, ...)."""
    policy = parse_kv_cache(kv_cache)  # a bad spelling fails before any loading
    folder = resolve_model_folder(model)
    return LoadedModel(
        backend=build_backend(folder, backend=backend, dtype=parse_dtype(dtype), gguf=model_gguf(model), numerics=numerics,
                              kv_cache=policy),
        tokenizer=HFTokenizer(folder),
        name=model or DEFAULT_MODEL,
    )


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
