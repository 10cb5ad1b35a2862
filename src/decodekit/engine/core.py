"""The decode loop: prefill, ask a method for tokens step by step, stop, stream, count.

A *step method* (plain decoding, every speculative method) only decides which tokens come
next; the loop here owns stopping (EOS, stop strings, max new tokens), streaming text
deltas and statistics. Whole-request methods (beam search, best-of-N, ...) implement
:class:`Decoder` directly and reuse the stop-string rule (``engine/stops.py``) and :class:`GenerationStats`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PromptTooLong
from ..models import LoadedModel
from ..models.backend import Backend, Interrupted
from ..models.kv_policy import KVPolicy
from ..samplers import Histories, Sampler
from .stops import cut_at_stop, hits_stop, settled, stop_strings, through_stop


@dataclass
class GenerationStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    new_tokens: int = 0
    forward_passes: int = 0  # decode-time forward passes (prefill not counted)
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific figures

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "new_tokens": self.new_tokens,
            "forward_passes": self.forward_passes,
            "tokens_per_s": round(self.tokens_per_s, 2),
            **self.extra,
        }


@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: GenerationStats
    finish_reason: str  # "eos" | "stop" | "length" | "cancelled"
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. candidates, uncertainty signals
    # tokens generated after ``tokens`` that a stop string cut off: the stop's own, and one whose
    # characters before the cut stay in ``text`` (:func:`.stops.shown_tokens`)
    cut_off: list[int] = field(default_factory=list)

    @classmethod
    def cancelled(cls) -> "Generation":
        """A request ended before it had an answer (cancelled while it waited, read its prompt or searched)."""
        return cls(text="", tokens=[], stats=GenerationStats(), finish_reason="cancelled")

    @property
    def generated(self) -> int:
        """Tokens the model generated, those a stop string cut off included (what a server bills)."""
        return len(self.tokens) + len(self.cut_off)

    def as_dict(self) -> dict[str, Any]:
        out = {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason, "stats": self.stats.as_dict()}
        if self.extra:
            out.update(self.extra)
        return out


@dataclass
class Request:
    """One generation request, already tokenised."""

    prompt_ids: list[int]
    sampler: Sampler
    max_new_tokens: int = 256
    stop: str | Sequence[str] = ()  # one string is one stop string
    on_text: Callable[[str], None] | None = None  # receives streamed text deltas
    # asked before the request, between a long prompt's passes and after every step: True ends it ("cancelled")
    should_stop: Callable[[], bool] | None = None
    ignore_eos: bool = False  # go on past end-of-sequence tokens (fixed-length benchmarks, as vLLM's ignore_eos)

    def __post_init__(self) -> None:
        self.stop = stop_strings(self.stop)


class DecodeState:
    """What a step method sees: the backend, the sampler and the tokens so far.

    Invariant: every token but possibly the last is in the backend's cache. When the last
    token is not (it was just chosen), it is *pending*; :meth:`next_logits` runs it.
    """

    def __init__(self, backend: Backend, sampler: Sampler, prompt_ids: list[int], stats: GenerationStats):
        self.backend = backend
        self.sampler = sampler
        self.tokens = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.stats = stats
        self._logits: torch.Tensor | None = None
        # what ends the request (the decode loop sets them): a method may spare passes whose
        # tokens would be thrown away
        self.max_new_tokens: int | None = None
        self.eos: frozenset[int] = frozenset()
        # how a drafter that samples draws its drafts (the speculative loop sets it from its
        # verifier's ``keyed_drafts``): with the target's keyed noise, or from the generator
        self.keyed_drafts = True
        # the request's output as its caller gets it, set by the decode loop before the method's
        # finish: through the end-of-sequence token that ended it, none of the tokens a step
        # produced past that token, a stop string or the length (None: not said; see ``generated``)
        self.output: list[int] | None = None

    @property
    def tokens_left(self) -> int | None:
        """New tokens the request still takes (None: not said)."""
        return None if self.max_new_tokens is None else self.max_new_tokens - len(self.tokens) + self.prompt_len

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def pending(self) -> int | None:
        """The last token when it is not yet in the cache, else None."""
        return self.tokens[-1] if self.backend.length < len(self.tokens) else None

    def history(self) -> Sequence[torch.Tensor]:
        """The token history in the form samplers take (one row, knowing where the prompt ends)."""
        if not self.sampler.needs_history:
            return [torch.empty(0, dtype=torch.long)]
        return Histories([list(self.tokens)], self.prompt_len)  # a copy: the tokens grow after the call

    def prefill(self) -> None:
        self._logits = self.backend.prefill(self.tokens)[0]

    def next_logits(self) -> torch.Tensor:
        """Logits ``[V]`` for the token after ``tokens`` (runs the pending token if needed)."""
        if self.pending is not None:
            if self.sampler.looks_ahead:  # e.g. a grammar's mask, computed while the pass runs
                self.sampler.prepare([self.generated])
            self._logits = self.backend.step(torch.tensor([self.pending]))[0]
            self.stats.forward_passes += 1
        assert self._logits is not None
        return self._logits

    def commit(self, new_tokens: Sequence[int], logits_after: torch.Tensor | None = None) -> None:
        """Record tokens chosen by the method. ``logits_after`` is given when the cache already holds them all."""
        self.tokens.extend(new_tokens)
        self._logits = logits_after


class StepMethod(ABC):
    """Produces one or more tokens per step (plain decoding is one; speculative methods more)."""

    name: str = "step"

    def check(self, backend: Backend) -> None:
        """Called before prefill: refuse (:class:`~decodekit.errors.InvalidParameter`) a model this method cannot run
        on, so that a request it cannot serve costs no prompt read; and set up, once per model, what is no part of
        the request's timed prefill (the speculative controller's verify costs)."""

    def check_kv_cache(self, policy: KVPolicy) -> None:
        """Called before the model loads: refuse a model cache policy this method cannot decode under."""

    def begin(self, state: DecodeState) -> None:
        """Called once after prefill (e.g. to index the prompt)."""

    @abstractmethod
    def step(self, state: DecodeState) -> list[int]:
        """Choose the next tokens, call ``state.commit`` with them, and return them."""

    def finish(self, state: DecodeState) -> None:
        """Called once at the end; add method figures to ``state.stats.extra``."""


class PlainDecoding(StepMethod):
    """One forward pass, one token: greedy or sampled by the request's sampler."""

    name = "plain"

    def step(self, state: DecodeState) -> list[int]:
        logits = state.next_logits()
        token = state.sampler.pick_at(logits, len(state.tokens), state.history())
        state.commit([token])
        return [token]


class Decoder(ABC):
    """Anything that turns a request into a generation."""

    #: Whether :meth:`generate` hands ``request.on_text`` the text as it comes. A search knows its
    #: answer only at the end: the engine hands over that whole text once, when it is chosen.
    streams: bool = False

    @abstractmethod
    def generate(self, model: LoadedModel, request: Request) -> Generation: ...

    def check_kv_cache(self, policy: KVPolicy) -> None:
        """Called before the model loads: refuse (:class:`~decodekit.errors.InvalidParameter`) a model
        cache policy this method cannot decode under, so that the refusal costs no model load."""


class Cancelled(Interrupted):
    """Raised inside a search when its request's ``should_stop`` says so. A search has no answer
    before its end to hand back, so the engine answers "cancelled" with no text, as it does for a
    prompt abandoned between its passes (:class:`Interrupted`, which this is one of)."""


def stop_requested(request: Request) -> bool:
    """Whether the request's ``should_stop`` says to end it now (asked after every step)."""
    return request.should_stop is not None and request.should_stop()


def check_cancelled(request: Request) -> None:
    """End a search's request here (:class:`Cancelled`) when its ``should_stop`` says so: asked at
    every step, as the decode loop asks it, so a client that went away frees its slot."""
    if stop_requested(request):
        raise Cancelled


def check_fits(backend: Backend, prompt_len: int, max_new_tokens: int) -> None:
    info = backend.info
    if prompt_len + max_new_tokens > info.max_length:
        raise PromptTooLong(f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens exceeds {info.length_limit()}")


class TextStreamer:
    """Turns the growing token list into text deltas, holding back what a stop string could still claim.

    A step decodes only the tokens after a *settled* prefix whose text is kept: the prefix moves up
    (to all but the last ``SETTLE`` tokens) once decoding it apart gives the same text as decoding
    it with what follows (not the case inside a multi-byte character, or where a tokenizer strips
    a leading space), so a step costs the same at any length of output."""

    SETTLE = 64

    def __init__(self, tokenizer, stop: Sequence[str], callback: Callable[[str], None] | None):
        self.tokenizer, self.stop, self.callback = tokenizer, [s for s in stop if s], callback
        self.sent = 0
        self.settled, self.settled_text = 0, ""  # tokens[:settled] decode to settled_text, whatever follows

    def _text(self, tokens: list[int]) -> str:
        decode = self.tokenizer.decode
        if len(tokens) - self.settled > 2 * self.SETTLE:
            cut = len(tokens) - self.SETTLE
            head = decode(tokens[self.settled : cut])
            if head + decode(tokens[cut:]) == decode(tokens[self.settled :]):
                self.settled, self.settled_text = cut, self.settled_text + head
        return self.settled_text + decode(tokens[self.settled :])

    def update(self, tokens: list[int], final_text: str | None = None) -> None:
        if self.callback is None:
            return
        text = final_text if final_text is not None else self._text(tokens)
        safe = len(text)
        if final_text is None:
            safe = len(settled(text))  # not an incomplete multi-byte character at the end
            safe -= stop_start_at_end(text[:safe], self.stop)
        if safe > self.sent:
            self.callback(text[self.sent : safe])
            self.sent = safe


def stop_start_at_end(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that a stop string starts with: text a stop
    string may still claim, so not streamed yet (the longest over all of them, whatever their order)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0)


class StepDecoder(Decoder):
    """Runs a :class:`StepMethod` inside the decode loop."""

    streams = True

    def __init__(self, method: StepMethod):
        self.method = method

    def check_kv_cache(self, policy: KVPolicy) -> None:
        self.method.check_kv_cache(policy)

    def generate(self, model: LoadedModel, request: Request) -> Generation:
        backend, tokenizer = model.backend, model.tokenizer
        check_fits(backend, len(request.prompt_ids), request.max_new_tokens)
        self.method.check(backend)
        stats = GenerationStats()
        state = DecodeState(backend, request.sampler, request.prompt_ids, stats)
        streamer = TextStreamer(tokenizer, request.stop, request.on_text)

        t0 = time.perf_counter()
        state.prefill()
        self.method.begin(state)
        t1 = time.perf_counter()
        stats.prefill_s = t1 - t0

        # a constraint allows the end-of-sequence token exactly where its grammar is complete and
        # nothing but it once nothing more can follow: there the output ends, ignore_eos or not
        eos = frozenset() if request.ignore_eos and not request.sampler.refuses_tokens else tokenizer.eos_token_ids
        state.max_new_tokens, state.eos = request.max_new_tokens, frozenset(eos)
        finish = "length"
        new: list[int] = []
        ended_by: list[int] = []  # the end-of-sequence token that ended the output
        while len(new) < request.max_new_tokens:
            before = len(new)
            produced = self.method.step(state)
            for token in produced:
                if token in eos:
                    finish, ended_by = "eos", [token]
                    break
                new.append(token)
                if len(new) == request.max_new_tokens:
                    break
            if finish == "eos":
                break
            if hits_stop(tokenizer, new, request.stop, added=len(new) - before):
                finish = "stop"
                break
            streamer.update(new)
            if stop_requested(request):
                finish = "cancelled"
                break
        broken = request.sampler.broken_by(new)
        if broken is not None:  # never hand back a silently wrong result
            raise RuntimeError(f"decodekit bug: {broken} ({self.method.name}); please report it")

        text, kept, hit = cut_at_stop(tokenizer, new, request.stop)
        if hit is not None:
            finish = "stop"
            new = through_stop(tokenizer, new, text, hit, len(kept))  # a step's tokens past the stop are not generated
        state.output = kept + ended_by if hit is None else list(kept)
        self.method.finish(state)
        stats.decode_s = time.perf_counter() - t1
        streamer.update(kept, final_text=text)
        stats.new_tokens = len(kept)
        return Generation(text=text, tokens=kept, stats=stats, finish_reason=finish, cut_off=new[len(kept):])
