"""External baselines on the same weights: transformers ``generate()`` and llama.cpp.

* ``hf``: transformers greedy ``generate()`` (``do_sample=False``), same prompt token ids.
* ``hf-pld``: the same with transformers' prompt lookup decoding (Saxena, 2023; ``prompt_lookup_num_tokens=10``),
  lossless: drafts are verified greedily.
* ``llamacpp``: llama-cpp-python on the model's GGUF file (greedy: temperature 0, top-k 1).
  It computes with the quantised GGUF weights in its own kernels (which also quantise the
  activations), while decodekit runs the same weights dequantised to float; near-ties then
  resolve differently (seen on SmolLM2's first answer token), so its text is compared only
  loosely and it is never counted in the exactness statistic.

All stop at the first EOS token decodekit's tokenizer knows (or after ``max_new_tokens``), like
decodekit's loop, and report the tokens each produced without the EOS. Prefill time is the time
to the first streamed new token; decode time is the rest.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import UnknownMethod
from ..models import LoadedModel
from ..models.loading import model_gguf, parse_dtype, resolve_model_folder
from .contestants import Contestant, RunResult, Stopwatch, cut_at_eos

BASELINES = ("hf", "hf-pld", "llamacpp")
PROMPT_LOOKUP_TOKENS = 10


class _FirstTokenStreamer:
    """A transformers streamer that only timestamps the first put after the prompt."""

    def __init__(self, watch: Stopwatch):
        self.watch, self.seen_prompt = watch, False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            self.watch.first_token()
        self.seen_prompt = True

    def end(self) -> None:
        pass


class HFGenerate(Contestant):
    """transformers ``generate()`` greedy (optionally with prompt lookup) on a given model object."""

    family = "baseline"
    lossless = True  # greedy; prompt lookup in transformers verifies greedily

    def __init__(self, hf_model, eos_token_ids: frozenset[int], decode: Callable[[Sequence[int]], str], *,
                 name: str = "hf", prompt_lookup: int | None = None, token_exact: bool = True):
        """``token_exact``: False against decodekit's ``fast`` numerics, whose 8-bit inputs are not
        transformers' float32 (its tokens are then compared as text, not one to one)."""
        self.model, self.eos, self.decode = hf_model.eval(), frozenset(eos_token_ids), decode
        self.name, self.prompt_lookup, self.token_exact = name, prompt_lookup, token_exact
        self.calls = 0

    def _count(self, *_: Any) -> None:
        self.calls += 1

    def generate_kwargs(self, max_new_tokens: int) -> dict[str, Any]:
        eos = sorted(self.eos)
        kwargs: dict[str, Any] = {
            "do_sample": False, "max_new_tokens": max_new_tokens, "eos_token_id": eos, "pad_token_id": eos[0] if eos else 0,
            # Neutralise sampling defaults a model's generation_config may carry.
            "temperature": None, "top_p": None, "top_k": None,
        }
        if self.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        return kwargs

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        watch = Stopwatch()
        self.calls = 0
        # Counting model forward calls gives the pass count for plain and prompt-lookup generation alike.
        hook = self.model.register_forward_hook(self._count)
        try:
            with torch.inference_mode(), quiet_transformers():
                out = self.model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), streamer=_FirstTokenStreamer(watch),
                    **self.generate_kwargs(max_new_tokens),
                )
        finally:
            hook.remove()
        prefill_s, decode_s = watch.split()
        produced = out[0, ids.shape[1]:].tolist()
        tokens, finish = cut_at_eos(produced, self.eos, max_new_tokens)
        return RunResult(tokens, self.decode(tokens), prefill_s, decode_s, finish, forward_passes=max(self.calls - 1, 0))


@contextlib.contextmanager
def quiet_transformers():
    """transformers warns about generation flags on every call; keep the progress bar readable."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def load_hf_model(model: str | None, dtype: str | torch.dtype):
    """The transformers model on the same (dequantised) weights decodekit loads."""
    from transformers import AutoModelForCausalLM

    from ..models.hf import quietly_loaded  # (no progress bars on the bench's stderr)

    torch.set_flush_denormal(True)  # as decodekit's backends do
    folder = resolve_model_folder(model)
    return quietly_loaded(lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(dtype)))


class LlamaCpp(Contestant):
    """llama-cpp-python greedy generation on a GGUF file (its own kernels and quantised weights)."""

    name = "llamacpp"
    lossless = None
    token_exact = False

    def __init__(self, gguf: Path, eos_token_ids: frozenset[int], *, n_threads: int, n_ctx: int = 4096):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
        self.eos = frozenset(eos_token_ids) | {self.llm.token_eos()}

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        self.llm.reset()  # no KV-prefix reuse across calls: every contestant prefills the whole prompt
        watch = Stopwatch()
        tokens: list[int] = []
        finish, produced = "length", 0
        for token in self.llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            watch.first_token()
            produced += 1
            if token in self.eos:
                finish = "eos"
                break
            tokens.append(token)
            if len(tokens) >= max_new_tokens:
                break
        prefill_s, decode_s = watch.split()
        text = self.llm.detokenize(tokens).decode("utf-8", errors="replace")
        return RunResult(tokens, text, prefill_s, decode_s, finish, forward_passes=max(produced - 1, 0))


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def check_baselines(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise UnknownMethod(f"unknown baseline {unknown[0]!r}; choose from: {', '.join(BASELINES)}")


def build_baselines(
    names: Sequence[str], loaded: LoadedModel, *, model: str | None, dtype: str, threads: int, hf_model=None,
    numerics: str = "exact",
) -> tuple[list[Contestant], list[str]]:
    """Build the requested baselines; returns them and notes on those skipped.

    ``hf_model`` (a transformers model object) is used instead of loading one, e.g. in tests.
    """
    check_baselines(names)
    built: list[Contestant] = []
    notes: list[str] = []
    eos, decode = loaded.tokenizer.eos_token_ids, loaded.tokenizer.decode
    for name in names:
        if name in ("hf", "hf-pld"):
            hf_model = hf_model if hf_model is not None else load_hf_model(model, dtype)
            lookup = PROMPT_LOOKUP_TOKENS if name == "hf-pld" else None
            built.append(HFGenerate(hf_model, eos, decode, name=name, prompt_lookup=lookup, token_exact=numerics == "exact"))
        elif name == "llamacpp":
            baseline, note = _llamacpp(loaded, model, threads)
            built.extend([baseline] if baseline else [])
            notes.extend([note] if note else [])
    return built, notes


def _llamacpp(loaded: LoadedModel, model: str | None, threads: int) -> tuple[Contestant | None, str | None]:
    if not llamacpp_available():
        return None, ("llamacpp baseline skipped: llama-cpp-python is not installed "
                      "(pip install 'decodekit[llamacpp]'; on CPUs without native flags build with "
                      "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON\")")
    gguf = model_gguf(model)
    if gguf is None:
        return None, f"llamacpp baseline skipped: model {model!r} has no GGUF file"
    note = (f"llamacpp runs the GGUF file {gguf.name} with its own quantised kernels, n_threads={threads}; "
            "its text is compared to decodekit greedy only loosely (not in the exactness statistic)")
    return LlamaCpp(gguf, loaded.tokenizer.eos_token_ids, n_threads=threads), note
