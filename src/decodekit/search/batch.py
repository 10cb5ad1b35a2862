"""Batched multi-sample decoding: N continuations of one prefix as one batch.

The prefix is run once and its cache forked to N rows; every step appends one token per row
(logits ``[N, 1, V]``). Rows stop on their own (EOS, stop string, step delimiter, length); a
finished row keeps feeding an EOS id that nobody reads, and the batch stops when every row is
done. Each row samples with its own seed, ``seed + i`` from the request's sampler, drawing the token
at each position with noise keyed by that seed and the position (``Sampler.sample_at``), so row i
of a batch is the same sample as a sequential ``sample`` run with seed ``seed + i`` (on the
native kernels a row's logits are bit for bit those it gets alone; elsewhere, up to float
rounding differences between batch sizes). Each step also records, from the raw
model distribution, what the scorers and uncertainty signals need: the chosen token's log-prob,
self-certainty KL(U || p), the top-2 margin and the top-K log-probs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.core import Generation, GenerationStats, Request, check_cancelled, check_fits
from ..engine.stops import cut_at_stop, hits_stop, through_stop
from ..models import LoadedModel
from ..models.kernels import argmax_rows
from ..samplers import Histories, Sampler
from ..options import OptionSpec
from ..samplers.params import SEED_LIMIT
from .cache import PrefixCache

#: The temperature a search draws its samples at when the request's sampler is greedy.
SAMPLE_TEMPERATURE = 0.7
SAMPLE_TEMPERATURE_OPTION = OptionSpec("sample_temperature", float, SAMPLE_TEMPERATURE,
                                       "temperature used when the request's sampler is greedy", lo=0.0)

#: Judge models (other than the request's own) a backend keeps a clone of, the most recently used.
KEPT_JUDGES = 2
TOPK_RECORDED = 10  # top-K log-probs kept per step (phi_first's default K)


@dataclass
class Sample:
    """One decoded continuation and its per-token record (raw model distribution).

    ``logprobs[i]``, ``certainty[i]``, ``margin[i]``, ``topk[i]`` describe the step that chose
    ``tokens[i]``; the step that chose EOS (when the row ended on it) is kept apart in ``eos_logprob``.
    ``cut_off``: the tokens a stop string cut off the end (the stop's, and one that held text before
    it), kept so that steps joined later are cut again exactly where the text is; ``cut_logprobs``
    their log-probabilities, which count in the sample's score as an EOS's does (the model chose to
    end there: without them a sample cut to nothing would score a perfect 0).
    """

    tokens: list[int]
    logprobs: list[float]
    certainty: list[float]
    margin: list[float]
    topk: list[list[float]]
    finish_reason: str  # eos | stop | length | step | unfinished
    text: str = ""
    eos_logprob: float | None = None
    cut_off: list[int] = field(default_factory=list)
    cut_logprobs: list[float] = field(default_factory=list)

    @property
    def loglik(self) -> float:
        """Sequence log-likelihood, its ending included: the EOS choice, or the tokens a stop
        string cut off."""
        return sum(self.logprobs) + (self.eos_logprob or 0.0) + sum(self.cut_logprobs)

    @property
    def mean_logprob(self) -> float:
        n = len(self.logprobs) + (self.eos_logprob is not None) + len(self.cut_logprobs)
        return self.loglik / n if n else 0.0

    @property
    def choices(self) -> int:
        """Tokens the model chose for this row, EOS included: what the row cost."""
        return len(self.tokens) + (self.eos_logprob is not None)

    @property
    def steps(self) -> int:
        """Steps the row took to finish: its choices and the tokens a stop string cut off."""
        return self.choices + len(self.cut_off)

    def cut(self, n: int) -> "Sample":
        """The first ``n`` tokens (after a stop-string cut)."""
        if n == len(self.tokens):
            return self
        return Sample(self.tokens[:n], self.logprobs[:n], self.certainty[:n], self.margin[:n], self.topk[:n],
                      self.finish_reason, self.text, None, self.tokens[n:] + self.cut_off,
                      self.logprobs[n:] + self.cut_logprobs)

    def then(self, other: "Sample") -> "Sample":
        """This sample followed by ``other`` (step-level search joins steps)."""
        return Sample(self.tokens + other.tokens, self.logprobs + other.logprobs, self.certainty + other.certainty,
                      self.margin + other.margin, self.topk + other.topk, other.finish_reason, "", other.eos_logprob,
                      other.cut_off, other.cut_logprobs)

    @classmethod
    def empty(cls) -> "Sample":
        return cls([], [], [], [], [], "unfinished")


class RowSamplers:
    """One processing chain, one sampler per slot (slot i seeded ``seed + i``)."""

    def __init__(self, sampler: Sampler):
        self.base = sampler
        self._made: dict[int, Sampler] = {}  # made when a row first draws: a huge n fails on its cache, not here

    def sampler(self, i: int) -> Sampler:
        """Slot ``i``'s sampler (seeded ``seed + i``)."""
        if i not in self._made:
            self._made[i] = Sampler(self.base.processors, greedy=self.base.is_greedy, seed=(self.base.seed + i) % SEED_LIMIT)
        return self._made[i]

    def fresh_slots(self, first: int, n: int) -> range:
        """Slots ``first .. first + n - 1``, none used before: a search that expands node after
        node gives each expansion its own, since draws are keyed by seed and position and two nodes
        at the same position drawing with the same seeds would get coupled samples."""
        return range(first, first + n)

    @property
    def greedy(self) -> bool:
        return self.base.is_greedy

    def pick(self, logits: torch.Tensor, histories: list[torch.Tensor] | None, slots: Sequence[int],
             positions: Sequence[int]) -> list[int]:
        """A token for each row of ``logits`` ``[n, V]``: row j is the token at ``positions[j]``
        drawn with slot ``slots[j]``'s seed (keyed, as plain sampling draws: see ``Sampler.sample_at``)."""
        processed = self.base.process(logits, histories)
        if self.greedy:
            return argmax_rows(processed)
        probs = torch.softmax(processed, dim=-1)
        return [self.sampler(s).sample_at(probs[j], positions[j]) for j, s in enumerate(slots)]


def row_means(x: torch.Tensor) -> torch.Tensor:
    """Each row's mean (float32), summed in one order whatever torch's thread count: torch splits a
    long row's sum between its threads, so a Ray worker pinned to one thread would get other last
    bits than a local run (numpy sums a row pairwise, alone)."""
    return torch.from_numpy(x.detach().double().numpy().mean(axis=-1)).float()


class StepRecorder:
    """Per-step statistics of the raw distributions, kept as tensors until the end."""

    def __init__(self, topk: int = TOPK_RECORDED):
        self.topk = topk
        self.chosen: list[torch.Tensor] = []
        self.certainty: list[torch.Tensor] = []
        self.margin: list[torch.Tensor] = []
        self.top: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, chosen: Sequence[int]) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = logp.topk(max(2, self.topk), dim=-1).values
        self.chosen.append(logp.gather(1, torch.tensor(list(chosen)).view(-1, 1))[:, 0])
        # (>= 0 as a KL divergence is: on a near-uniform row rounding gives -1e-7, which scorers refuse)
        self.certainty.append((-math.log(logp.shape[-1]) - row_means(logp)).clamp(min=0.0))
        self.margin.append(top[:, 0].exp() - top[:, 1].exp())
        self.top.append(top[:, : self.topk])

    def row(self, i: int, n_tokens: int, ended_eos: bool) -> tuple[list[float], list[float], list[float], list[list[float]], float | None]:
        steps = len(self.chosen)
        chosen = torch.stack(self.chosen)[:, i].tolist() if steps else []
        cert = torch.stack(self.certainty)[:n_tokens, i].tolist() if steps else []
        margin = torch.stack(self.margin)[:n_tokens, i].tolist() if steps else []
        top = torch.stack(self.top)[:n_tokens, i].tolist() if steps else []
        eos = chosen[n_tokens] if ended_eos else None
        return chosen[:n_tokens], cert, margin, top, eos


def step_done(text: str, delimiter: str) -> bool:
    """True when ``text`` holds the delimiter after some content (a leading delimiter does not count):
    text before it that is neither whitespace nor the delimiter itself (the string, not its letters)."""
    start = text.find(delimiter)
    while start >= 0:
        if text[:start].replace(delimiter, "").strip(" \t\n"):
            return True
        start = text.find(delimiter, start + 1)
    return False


class SearchContext:
    """Everything one request's search needs: model, request, prefix cache, statistics, seeds."""

    def __init__(self, model: LoadedModel, request: Request):
        check_fits(model.backend, len(request.prompt_ids), request.max_new_tokens)
        self.model = model
        self.request = request
        self.tokenizer = model.tokenizer
        self.cache = PrefixCache(model.backend)
        self.eos = frozenset(model.tokenizer.eos_token_ids)
        self.pad = min(self.eos) if self.eos else 0
        self.spent = 0  # tokens chosen by the model over all candidates (EOS included)
        self.t0 = time.perf_counter()
        self._judge_caches: dict[int, PrefixCache] = {}

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_ids

    def cache_for(self, model: LoadedModel, shared: bool = True) -> PrefixCache:
        """A prefix cache of ``model`` for this request: its own cache for its own model; for another
        (a judge) that is ``shared``, one over a clone this request's backend keeps, never ``model``'s
        own cache, which may hold a request of its own on another thread."""
        if model.backend is self.model.backend:
            return self.cache
        if id(model.backend) not in self._judge_caches:
            backend = self.model.backend.own_clone(model.backend, "judge", keep=KEPT_JUDGES) if shared else model.backend
            self._judge_caches[id(model.backend)] = PrefixCache(backend)
        return self._judge_caches[id(model.backend)]

    def row_samplers(self, temperature: float | None = None) -> RowSamplers:
        sampler = self.request.sampler if temperature is None else self.request.sampler.sampling(temperature)
        return RowSamplers(sampler)

    def greedy_rows(self) -> RowSamplers:
        """Greedy rows over the request's processing chain, whatever its sampling setting."""
        sampler = self.request.sampler
        return RowSamplers(Sampler(sampler.processors, greedy=True, seed=sampler.seed))

    def decode(
        self,
        prefix: Sequence[int],
        rows: RowSamplers,
        slots: Sequence[int],
        max_new_tokens: int,
        *,
        delimiter: str | None = None,
        first_tokens: Sequence[int] | None = None,
        stop_on_first: bool = False,
    ) -> list[Sample]:
        """Decode one continuation of ``prefix`` per slot, as one batch (see the module doc).

        ``delimiter`` ends a row when its new text holds the delimiter after some content
        (finish reason ``step``); ``first_tokens`` forces each row's first token;
        ``stop_on_first`` ends the batch as soon as any row finishes (others: ``unfinished``).
        """
        prefix, n = list(prefix), len(slots)
        answer = prefix[len(self.prompt) :]  # a step search's steps so far: a stop string may begin there
        logits = self.cache.fork(prefix, n)
        tokens: list[list[int]] = [[] for _ in range(n)]
        done: list[str | None] = [None] * n
        recorder = StepRecorder()
        for t in range(max_new_tokens):
            check_cancelled(self.request)
            active = [i for i in range(n) if done[i] is None]
            chosen = self._choose(logits, prefix, tokens, rows, slots, active, first_tokens if t == 0 else None)
            recorder.add(logits, chosen)
            self.spent += len(active)
            for i in active:
                done[i] = self._advance(tokens[i], chosen[i], max_new_tokens, delimiter, answer)
            if all(done) or (stop_on_first and any(d in ("eos", "stop") for d in done)):
                break
            logits = self.cache.step([tokens[i][-1] if done[i] is None else self.pad for i in range(n)])
        return [self._sample(recorder, i, tokens[i], done[i] or "unfinished", answer) for i in range(n)]

    def _choose(self, logits, prefix, tokens, rows, slots, active, forced) -> list[int]:
        chosen = [self.pad] * len(tokens)
        if forced is not None:
            for i in active:
                chosen[i] = int(forced[i])
            return chosen
        histories = (
            Histories([prefix + tokens[i] for i in active], len(self.prompt)) if rows.base.needs_history else None
        )
        positions = [len(prefix) + len(tokens[i]) for i in active]  # where in its sequence each token goes
        picked = rows.pick(logits[active], histories, [slots[i] for i in active], positions)
        for i, token in zip(active, picked):
            chosen[i] = token
        return chosen

    def _advance(self, row: list[int], token: int, limit: int, delimiter: str | None, answer: list[int]) -> str | None:
        """Add ``token`` to ``row`` (which follows ``answer``); the finish reason if the row is now
        done, else None."""
        if token in self.eos:
            return "eos"
        row.append(token)
        if hits_stop(self.tokenizer, answer + row if answer else row, self.request.stop):
            return "stop"
        if delimiter and step_done(self.tokenizer.decode(row), delimiter):
            return "step"
        return "length" if len(row) >= limit else None

    def _sample(self, recorder: StepRecorder, i: int, tokens: list[int], reason: str, answer: list[int]) -> Sample:
        lps, cert, margin, top, eos = recorder.row(i, len(tokens), reason == "eos")
        sample = Sample(tokens, lps, cert, margin, top, reason, eos_logprob=eos)
        text, kept, hit = cut_at_stop(self.tokenizer, answer + tokens, self.request.stop)
        if len(kept) >= len(answer):  # else the stop began in the steps before: the row is kept whole, finalize cuts
            sample = sample.cut(len(kept) - len(answer))
        sample.text = text if not answer else self.tokenizer.decode(sample.tokens)
        if hit is not None:
            sample.finish_reason = "stop"
        return sample

    def finalize(self, sample: Sample, extra: dict[str, Any]) -> Generation:
        """The request's Generation for the chosen sample; statistics over the whole search."""
        # the steps of a step search, joined, may hold a stop string across a step's boundary
        generated = list(sample.tokens) + sample.cut_off
        # as the decode loop does: a constraint's mask that allows no token (a dead end: text no token
        # writes) leaves a search's rows to go on unmasked, so the answer is checked, never handed back broken
        broken = self.request.sampler.broken_by(generated)
        if broken is not None:
            raise RuntimeError(f"decodekit bug: {broken} ({extra.get('method', 'search')}); please report it")
        text, tokens, hit = cut_at_stop(self.tokenizer, generated, self.request.stop)
        if hit is not None:
            generated = through_stop(self.tokenizer, generated, text, hit, len(tokens))
        stats = GenerationStats(
            prefill_s=self.cache.first_prefill_s,
            decode_s=time.perf_counter() - self.t0 - self.cache.first_prefill_s,
            new_tokens=len(tokens),
            forward_passes=max(self.cache.passes - 1, 0),
        )
        stats.extra["tokens_spent"] = self.spent
        stats.extra["positions_run"] = self.cache.tokens_run
        if hit is None:  # the sample's own text: cut at a stop string inside a token, it may end past its tokens'
            text = sample.text or text
        reason = "stop" if hit is not None else sample.finish_reason if sample.finish_reason in ("eos", "stop") else "length"
        return Generation(text=text, tokens=tokens, stats=stats, finish_reason=reason, extra=extra,
                          cut_off=generated[len(tokens):])


def decode_batch(model: LoadedModel, request: Request, n: int, *, temperature: float | None = None) -> list[Sample]:
    """N samples of one request in one batch (row i seeded ``seed + i``); the Python entry point."""
    ctx = SearchContext(model, request)
    return ctx.decode(ctx.prompt, ctx.row_samplers(temperature), range(n), request.max_new_tokens)
