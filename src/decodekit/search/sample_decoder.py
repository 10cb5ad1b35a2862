"""One continuation through the batched machinery, with the uncertainty signals it carries."""

from __future__ import annotations

from collections.abc import Callable

from ..engine.core import Decoder, Generation, Request
from ..models import LoadedModel
from .answers import answer_start
from .batch import SearchContext
from .uncertainty import sample_signals


class SampleDecoder(Decoder):
    """One continuation through the batched machinery, returned with its uncertainty signals.

    Greedy (or sampled) exactly like plain decoding, plus ``extra['uncertainty']``; ``decodekit
    eval`` uses it for ``--method greedy|sample`` so that phi_first and friends come for free.
    ``answer_start(text)`` says where the answer begins (default: the last number, else 0).
    """

    def __init__(self, answer_start: Callable[[str], int] | None = None):
        self.answer_start = answer_start

    def generate(self, model: LoadedModel, request: Request) -> Generation:
        ctx = SearchContext(model, request)
        sample = ctx.decode(ctx.prompt, ctx.row_samplers(), [0], request.max_new_tokens)[0]
        start = self.answer_start(sample.text) if self.answer_start else answer_start(sample.text, "auto")
        signals = sample_signals(sample, model.tokenizer, start)
        return ctx.finalize(sample, {"method": "sample" if not request.sampler.is_greedy else "greedy",
                                     "uncertainty": signals})
