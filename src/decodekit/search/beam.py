"""Beam search with a length penalty and flexible-beam pruning.

Scores are sums of log-probs of the sampler-processed distribution (so penalties and temperature
apply; plain logits by default). A finished hypothesis is ranked by
``logP / lp(|Y|)`` with the GNMT length penalty (Wu et al., 2016, "Google's Neural Machine
Translation System"): ``lp(|Y|) = ((5 + |Y|) / 6) ** alpha``, |Y| counting the EOS token;
``alpha = 0`` is no penalty. Flexible beam (Freitag & Al-Onaizan, 2017, "Beam Search Strategies
for Neural Machine Translation", relative threshold pruning): at every step, a candidate whose
probability is below ``prune_ratio`` times the best candidate's is dropped, so the beam shrinks
when the model is sure (the cache rows are then reordered into fewer rows). Our choices: like
Hugging Face, 2·width candidates are ranked per step and an EOS candidate only finishes when it
ranks within the width; the search stops once ``width`` hypotheses have finished (HF's
``early_stopping=True``) or at ``max_new_tokens`` (unfinished beams then compete as they are).
Stop strings cut the returned text afterwards (they do not end beams). Candidates of equal score
rank by lower token id, as greedy's argmax takes them (HF's ``topk`` leaves their order open). Not
lossless; width 1 is exactly greedy decoding, ties included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..engine.core import Decoder, Generation, Request, check_cancelled
from ..engine.stops import cut_at_stop
from ..models import LoadedModel
from ..options import OptionSpec, option_table
from ..samplers import Histories
from .batch import Sample, SearchContext

OPTIONS = option_table(
    OptionSpec("n", int, 4, "beam width", lo=1),
    OptionSpec("length_penalty", float, 0.6, "GNMT alpha (0 = none; the paper tunes it in [0.6, 1])", lo=0.0, hi=10.0),
    OptionSpec("prune_ratio", float, 0.0, "relative-threshold pruning rp (0 = off)", lo=0.0, hi=1.0),
)


def gnmt_penalty(length: int, alpha: float) -> float:
    return ((5 + length) / 6) ** alpha


@dataclass
class Hypothesis:
    tokens: list[int]
    logp: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"

    def score(self, alpha: float) -> float:
        return self.logp / gnmt_penalty(len(self.logprobs), alpha)


def best_entries(scores: torch.Tensor, k: int) -> tuple[list[float], list[int]]:
    """The ``k`` largest of ``scores`` (1-D) and their indices, highest first, ties to the lower index,
    as greedy decoding's argmax takes them: a beam of width 1 is then greedy decoding exactly
    (``topk`` orders tied entries as it likes)."""
    kth = scores.topk(k).values[-1]
    chosen = torch.cat([(scores > kth).nonzero().view(-1), (scores == kth).nonzero().view(-1)])[:k].sort().values
    chosen = chosen[scores[chosen].sort(descending=True, stable=True).indices]
    return scores[chosen].tolist(), chosen.tolist()


class BeamSearch(Decoder):
    def __init__(self, n: int = 4, length_penalty: float = 0.6, prune_ratio: float = 0.0):
        self.width, self.alpha, self.prune = n, length_penalty, prune_ratio

    def generate(self, model: LoadedModel, request: Request) -> Generation:
        ctx = SearchContext(model, request)
        logits = ctx.cache.fork(ctx.prompt, 1)
        beams, finished = [Hypothesis([])], []
        for length in range(1, request.max_new_tokens + 1):
            check_cancelled(request)
            histories = (
                Histories([ctx.prompt + b.tokens for b in beams], len(ctx.prompt)) if request.sampler.needs_history else None
            )
            logp = torch.log_softmax(request.sampler.process(logits, histories), dim=-1)
            ctx.spent += len(beams)
            beams, parents, ended = self._advance(beams, logp, ctx.eos)
            finished += ended
            if len(finished) >= self.width or not beams or length == request.max_new_tokens:
                break  # (no pass for logits nobody reads)
            ctx.cache.select(parents)
            logits = ctx.cache.step([b.tokens[-1] for b in beams])
        pool = finished + [b for b in beams if b.finish_reason == "length"] if len(finished) < self.width else finished
        ranked = sorted(pool, key=lambda h: h.score(self.alpha), reverse=True)
        return self._result(ctx, ranked)

    def _advance(self, beams: list[Hypothesis], logp: torch.Tensor, eos: frozenset[int]):
        """One step: new beams, the cache rows they extend, and hypotheses that ended on EOS."""
        total = torch.tensor([b.logp for b in beams]).view(-1, 1) + logp
        vocab = logp.shape[-1]
        k = min(2 * self.width, int(torch.isfinite(total).sum()))
        values, flat = best_entries(total.view(-1), k)
        floor = values[0] + (math.log(self.prune) if self.prune > 0 else -math.inf)
        new, parents, ended = [], [], []
        for rank, (value, index) in enumerate(zip(values, flat)):
            if value < floor or len(new) == self.width:
                break
            parent, token = divmod(index, vocab)
            src = beams[parent]
            hyp = Hypothesis(src.tokens + [token], value, src.logprobs + [value - src.logp])
            if token in eos:
                if rank < self.width:
                    hyp.tokens.pop()
                    hyp.finish_reason = "eos"
                    ended.append(hyp)
                continue
            new.append(hyp)
            parents.append(parent)
        return new, parents, ended

    def _result(self, ctx: SearchContext, ranked: list[Hypothesis]) -> Generation:
        best = ranked[0]
        n = len(best.tokens)
        eos_lp = best.logprobs[n] if best.finish_reason == "eos" else None
        sample = Sample(best.tokens, best.logprobs[:n], [], [], [], best.finish_reason, eos_logprob=eos_lp)
        sample.text, kept, hit = cut_at_stop(ctx.tokenizer, sample.tokens, ctx.request.stop)
        if hit is not None:
            sample = sample.cut(len(kept))
            sample.finish_reason = "stop"
        candidates = [
            {"text": ctx.tokenizer.decode(h.tokens), "score": round(h.score(self.alpha), 4),
             "logp": round(h.logp, 4), "tokens": len(h.tokens), "finish_reason": h.finish_reason}
            for h in ranked
        ]
        extra = {"method": "beam", "candidates": candidates,
                 "uncertainty": {"mean_logprob": sample.mean_logprob if sample.choices else None}}
        return ctx.finalize(sample, extra)
