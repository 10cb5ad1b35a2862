"""CoT-decoding (Wang & Zhou, 2024, "Chain-of-Thought Reasoning Without Prompting").

Branch on the top-k first tokens (EOS excluded; where the sampler leaves only EOS, the one path is
the empty answer), continue every branch greedily (one batch of k
rows), and return the path with the highest answer confidence
Δ = mean over the answer tokens of (p_top1 − p_top2), from the raw model distribution.
Answer span (our choice, as the paper leaves it task-specific): with ``answer='number'`` or
``'auto'``, the tokens overlapping the last number of the continuation; with an ``answer_start``
callable (a task's, as ``decodekit eval`` passes it), the tokens from that offset to the end of its
line; otherwise (no number, ``answer='text'`` or ``'line'``, or an ``answer`` callable alone) the
whole continuation. The answers compared by ``aggregate`` are ``answer``'s, a callable's included
(an eval task's own extractor). ``aggregate=True`` is the paper's
"CoT-decoding (agg)": sum Δ over paths with the same extracted answer, pick the best answer and
return its highest-Δ path. Not lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..engine.core import Decoder, Generation, Request
from ..models import LoadedModel
from ..models.tokenizer import Tokenizer
from ..options import OptionSpec, option_table
from ..samplers import Histories
from .answers import ANSWER_MODES, ANSWER_START_OPTION, Extractor, answer_functions, last_number_span, mode_of
from .batch import SearchContext
from .select import majority_vote
from .uncertainty import sample_signals, token_ends

OPTIONS = option_table(
    OptionSpec("n", int, 10, "number of first-token branches k", lo=1),
    OptionSpec("answer", str, "auto", "answer extraction and span: number/auto (last number) or text (all)",
               choices=ANSWER_MODES, allow_callable=True),
    OptionSpec("aggregate", bool, False, "sum Δ over paths with the same answer"),
    ANSWER_START_OPTION,
)


def line_span(text: str, begin: int) -> tuple[int, int] | None:
    """From ``begin`` to the end of its line, or None where that holds no text."""
    end = text.find("\n", begin)
    end = len(text) if end < 0 else end
    return (begin, end) if text[begin:end].strip() else None


def answer_token_span(tokens: Sequence[int], tokenizer: Tokenizer, mode: str | Extractor,
                      start: Callable[[str], int] | None = None) -> list[int]:
    """Indices of the answer tokens (see the module doc)."""
    text = tokenizer.decode(tokens)
    span = last_number_span(text) if mode in ("number", "auto") else None
    if span is None and start is not None:
        span = line_span(text, start(text))
    if span is None:
        return list(range(len(tokens)))
    ends = token_ends(tokens, tokenizer)
    starts = [0] + ends[:-1]
    return [i for i in range(len(tokens)) if starts[i] < span[1] and ends[i] > span[0]]


def path_confidence(margins: Sequence[float], span: Sequence[int]) -> float:
    """Δ: the mean top-1 − top-2 probability margin over the answer tokens (0 for an empty span)."""
    return sum(margins[i] for i in span) / len(span) if span else 0.0


def choose_path(deltas: Sequence[float], answers: Sequence[str | None] | None = None) -> int:
    """Highest Δ; with ``answers``, the best path of the answer with the largest total Δ."""
    if answers is None:
        return max(range(len(deltas)), key=lambda i: deltas[i])
    winner, _ = majority_vote(answers, deltas)
    pool = [i for i in range(len(deltas)) if answers[i] == winner] or list(range(len(deltas)))
    return max(pool, key=lambda i: deltas[i])


class CoTDecoding(Decoder):
    def __init__(self, n: int = 10, answer: str | Callable[[str], str | None] = "auto", aggregate: bool = False,
                 answer_start: Callable[[str], int] | None = None):
        self.k, self.mode, self.aggregate = n, mode_of(answer), aggregate
        self.extract, self.start = answer_functions(answer, answer_start)
        self.span_start = self.start if answer_start is not None else None  # a given start begins the Δ span too

    def generate(self, model: LoadedModel, request: Request) -> Generation:
        ctx = SearchContext(model, request)
        first = self._first_tokens(ctx)
        greedy = ctx.greedy_rows()
        samples = ctx.decode(ctx.prompt, greedy, range(len(first)), request.max_new_tokens, first_tokens=first)
        deltas = [path_confidence(s.margin, answer_token_span(s.tokens, ctx.tokenizer, self.mode, self.span_start))
                  for s in samples]
        answers = [self.extract(s.text) for s in samples]
        index = choose_path(deltas, answers if self.aggregate else None)
        paths = [
            {"first_token": ctx.tokenizer.decode([t]), "text": s.text, "answer": a, "delta": round(d, 6)}
            for t, s, a, d in zip(first, samples, answers, deltas)
        ]
        signals = sample_signals(samples[index], ctx.tokenizer, self.start(samples[index].text))
        signals["delta"] = deltas[index]
        extra = {"method": "cot", "chosen": index, "answer": answers[index], "candidates": paths, "uncertainty": signals}
        return ctx.finalize(samples[index], extra)

    def _first_tokens(self, ctx: SearchContext) -> list[int]:
        logits = ctx.cache.fork(ctx.prompt, 1)
        history = Histories([ctx.prompt], len(ctx.prompt)) if ctx.request.sampler.needs_history else None
        processed = ctx.request.sampler.process(logits, history)[0]
        branches = processed.clone()
        branches[list(ctx.eos)] = float("-inf")
        k = min(self.k, int(branches.isfinite().sum()))
        if k == 0:  # the sampler leaves nothing but an end of text: the one path is the empty answer
            return [int(processed.argmax())]
        return branches.topk(k).indices.tolist()
