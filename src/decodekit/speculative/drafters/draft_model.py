"""Draft-model drafting: a smaller causal LM proposes a chain, the target verifies it.

Papers: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling".
Lossless: the drafter only proposes; the verifier accepts greedily (output token-identical to
plain greedy) or, for sampled requests, by keyed sampling (token-identical to plain sampling with
the same seed; the default) or by speculative sampling with the recorded draft distribution q
(``SamplingVerifier``: distributed exactly as plain sampling).

Choices the papers leave open (each one tested):
  * The draft model must share the target's tokenizer; it may have a differently padded
    vocabulary (its logits are cut or padded with -inf to the target's size). One that differs by
    more than a padding (``VOCAB_PADDING``), or is asked to read a token past its vocabulary, is refused.
  * The draft keeps its own cache in sync with ``state.tokens``: roll back to the longest
    common prefix, then append every missing token in one forward pass (only the last
    position's logits are computed). The prompt too is run by the first draft, not up front.
  * Greedy requests get greedy drafts; sampling requests get drafts sampled from the
    request's processed distribution (temperature, top-p, ... applied to the draft logits),
    recorded as ``draft_probs``; ``stochastic=False`` drafts greedily even then.
  * Early stop (as in SWIFT): drafting ends before a token whose draft top-1 probability is
    below ``confidence``. The test uses only q, before any draw, so sampled tokens stay
    exactly q-distributed.
  * ``draft_model="self-truncated:N"``: the target's first N layers + final norm + lm head,
    sharing the target's weights (a weak but download-free draft model; native backend only).
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import AbstractContextManager, nullcontext

import torch

from ...engine.core import DecodeState
from ...errors import InvalidParameter
from ...models.backend import Backend, common_prefix
from ...options import OptionSpec, option_table
from . import register_drafter
from .base import CHAIN_CAP, CHAIN_CONFIDENCE, CHAIN_OPTIONS, ChainDrafter

SELF_TRUNCATED = "self-truncated:"


# Draft-model backends --------------------------------------------------------------------------

#: The weights of the last draft model loaded from a folder, shared by every target: each target
#: keeps its own clone (its own cache) in its memory.
_loaded: dict[tuple[str, torch.dtype], Backend] = {}
_LOADING = threading.Lock()


def parse_draft_spec(spec: object) -> Backend | int | str:
    """Validate ``draft_model``: a Backend, a layer count (self-truncated:N) or a model folder."""
    if isinstance(spec, Backend):
        return spec
    if not isinstance(spec, str) or not spec:
        raise InvalidParameter(
            "method 'draft' needs draft_model= a model folder, .gguf file, embedded name or self-truncated:N"
        )
    if spec.startswith(SELF_TRUNCATED):
        n = spec[len(SELF_TRUNCATED) :]
        if not n.isdigit() or int(n) < 1:
            raise InvalidParameter(f"draft_model {spec!r}: expected self-truncated:N with N a positive layer count")
        return int(n)
    from ...models.loading import resolve_model_folder

    return str(resolve_model_folder(spec))  # ModelNotFound (one line) before any work


#: Draft models a target keeps built across requests (the most recently used): requests that vary
#: ``draft_model`` must not grow memory without bound.
KEPT_DRAFTS = 2
#: How many tokens a draft model's vocabulary may differ by from the target's (a padded one).
VOCAB_PADDING = 1024


def draft_backend(spec: Backend | int | str, target: Backend) -> Backend:
    """The draft backend for a parsed spec, built once and reused across requests."""
    if isinstance(spec, Backend):
        if spec is target:
            raise InvalidParameter("draft_model must not be the target backend itself (it needs its own cache)")
        return target.own_clone(spec, "draft", keep=KEPT_DRAFTS)  # spec may be decoding a request of its own
    if isinstance(spec, int):  # kept in the target's memory: a clone of the target makes its own
        try:
            return target.memory(("draft.truncated", spec), lambda: target.truncated(spec), keep=KEPT_DRAFTS)
        except InvalidParameter as err:
            raise InvalidParameter(f"draft_model {SELF_TRUNCATED}{spec}: {err}", param="draft_model") from None
    key = (_one_spelling(spec), target.info.dtype)
    return target.memory(("draft.model", *key), lambda: _draft_weights(key).clone(), keep=KEPT_DRAFTS)


def _one_spelling(spec: str) -> str:
    """A folder or file by its resolved path (``m`` and ``m/../m`` are one model, loaded once); a
    model's name as given."""
    from ...arguments import user_path

    path = user_path(spec)
    return str(path.resolve()) if path.exists() else spec


def _draft_weights(key: tuple[str, torch.dtype]) -> Backend:
    """The draft model of a folder, loaded once (at most one kept here, as the source of the clones
    targets keep)."""
    with _LOADING:
        if key not in _loaded:
            from pathlib import Path

            from ...models.loading import build_backend

            _loaded.clear()
            _loaded[key] = build_backend(Path(key[0]), dtype=key[1])
        return _loaded[key]


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Cut or -inf-pad draft logits ``[V']`` to the target's vocabulary size."""
    if logits.shape[-1] == vocab_size:
        return logits
    if logits.shape[-1] > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


OPTIONS = option_table(
    OptionSpec("draft_model", object, None, "the draft model: a model name, folder or .gguf, a Backend, or self-truncated:N",
               local=lambda value: not (isinstance(value, str) and value.startswith(SELF_TRUNCATED))),
    CHAIN_OPTIONS,
    dataclasses.replace(CHAIN_OPTIONS["stochastic"], default=True),
)


class DraftModelDrafter(ChainDrafter):
    """Speculative decoding with a separate draft model (Leviathan et al. 2023; Chen et al. 2023).

    Lossless under the project's verifiers. Options: ``draft_model`` (model spec, Backend or
    ``self-truncated:N``), ``max_draft`` (chain length cap), ``confidence`` (early-stop
    threshold on the draft's top-1 probability), ``stochastic`` (sample drafts when the
    request samples). See the module docstring for the choices made.
    """

    name = "draft"

    def __init__(
        self,
        *,
        draft_model: str | Backend | None = None,
        max_draft: int | None = CHAIN_CAP,
        confidence: float = CHAIN_CONFIDENCE,
        stochastic: bool = True,
    ):
        super().__init__(max_draft=max_draft, confidence=confidence, stochastic=stochastic)
        self.spec = self._parse_spec(draft_model)
        self.backend: Backend | None = None
        self._cached: list[int] = []  # mirrors the draft cache
        self._vocab = 0  # the target's vocabulary size

    def _parse_spec(self, spec: object) -> Backend | int | str | None:
        return parse_draft_spec(spec)

    def check(self, backend: Backend) -> None:
        self.backend = draft_backend(self.spec, backend)
        draft, target = self.backend.info.vocab_size, backend.info.vocab_size
        if abs(draft - target) > VOCAB_PADDING:  # not a padding apart: another tokenizer, whose ids mean other tokens
            raise InvalidParameter(f"the draft model's vocabulary ({draft} tokens) is not the target's ({target}): a draft "
                                   "model must share the target's tokenizer", param="draft_model")

    def begin(self, state: DecodeState) -> None:
        # The prompt is run lazily, by the first draft: a request whose controller never
        # drafts (the draft model does not pay) costs the draft model nothing.
        self.check(state.backend)  # again for a drafter used without the loop: kept in the target's memory
        assert self.backend is not None
        self.backend.reset(1)
        self._cached = []

    def _append(self, tokens: list[int]) -> torch.Tensor:
        assert self.backend is not None
        if (largest := max(tokens)) >= self.backend.info.vocab_size:  # the target's padding, or another tokenizer
            raise InvalidParameter(f"token {largest} is past the draft model's vocabulary of "
                                   f"{self.backend.info.vocab_size}: a draft model must share the target's tokenizer",
                                   param="draft_model")
        out = self.backend.append(torch.tensor([tokens]), last_only=True)
        self._cached.extend(tokens)
        self.last_steps += 1
        return out.logits[0, -1]

    def _start(self, state: DecodeState, budget: int) -> tuple[torch.Tensor | None, int]:
        if self.backend is None:
            raise RuntimeError("DraftModelDrafter.draft() before begin()")
        tokens = state.tokens
        budget = min(budget, self.backend.info.max_length - len(tokens))
        if budget <= 0:
            return None, 0
        # Keep the longest common prefix, but always run at least the root to get its logits.
        keep = min(common_prefix(self._cached, tokens), len(tokens) - 1)
        self.backend.truncate(keep)
        del self._cached[keep:]
        self._vocab = state.backend.info.vocab_size
        logits = fit_vocab(self._append(tokens[keep:]), self._vocab)
        # the chain's own passes (one a token after the first) start here, and are rolled back past
        # what the target does not accept at the next draft: no more than the cache can roll back now
        return logits, 1 + self.within_rollback(budget - 1, self.backend)

    def _chain_cache(self) -> AbstractContextManager:
        # (the catch-up in _start, tokens the target has taken, compacts the draft's cache as a step would)
        return self.backend.compaction_held() if self.backend is not None else nullcontext()

    def _advance(self, token: int) -> torch.Tensor:
        return fit_vocab(self._append([token]), self._vocab)


register_drafter(
    "draft", "a smaller draft model proposes a chain (draft_model=PATH or self-truncated:N)",
    options=OPTIONS,
)(DraftModelDrafter)
