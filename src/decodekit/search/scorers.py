"""Scorers for candidates and steps: higher is better.

One interface serves best-of-N (a whole answer) and step-level search (a process-reward model,
``StepScorer``): ``score(ctx, prefix, segment)`` rates ``segment`` (a :class:`Sample`) decoded after
the prompt and ``prefix`` (empty for whole answers); step searches call ``score_step`` (the same,
``prefix`` the earlier steps' ids, possibly none), which a scorer that asks differently about a
step overrides (the judge).

Built in:
  ``loglik``         sum of token log-probs (EOS included when the answer ended on it)
  ``mean-logprob``   the same, per token
  ``prob``           exp(mean-logprob), the "normalised weighted sum" weight of Wang et al. (2023)
  ``self-certainty`` mean KL(U || p) over the tokens (Kang et al., 2025)
  ``judge``          LM-as-judge: p(yes) / (p(yes) + p(no)) after asking "Is this answer correct?"
                     (for steps: "Is the last step correct?") in the same conversation
A Python callable ``text -> float`` is also a scorer (it gets the answer text so far).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from numbers import Real

import torch

from ..engine.core import Request
from ..errors import InvalidParameter, PromptTooLong
from ..models import LoadedModel
from ..options import OptionSpec, any_value, finite
from .batch import Sample, SearchContext


class Scorer(ABC):
    """Rates a segment; ``nonnegative`` scorers can also serve as voting weights."""

    name = "scorer"
    nonnegative = False

    def check(self, model: LoadedModel, request: Request | None = None) -> None:
        """Called before a search decodes anything: refuse (:class:`InvalidParameter`) a generating
        model this scorer cannot score, or (:class:`PromptTooLong`) a request whose answers it could not
        read within its model's context, so that the refusal costs no samples."""

    @abstractmethod
    def score(self, ctx: SearchContext, prefix: Sequence[int], segment: Sample) -> float: ...

    def score_step(self, ctx: SearchContext, prefix: Sequence[int], step: Sample) -> float:
        """A step of a solution, after the earlier steps ``prefix`` (none for the first step)."""
        return self.score(ctx, prefix, step)


StepScorer = Scorer  # a process-reward model is a scorer applied to each new step


class LogLikelihood(Scorer):
    name = "loglik"

    def score(self, ctx: SearchContext, prefix: Sequence[int], segment: Sample) -> float:
        return segment.loglik


class MeanLogprob(Scorer):
    name = "mean-logprob"

    def score(self, ctx: SearchContext, prefix: Sequence[int], segment: Sample) -> float:
        return segment.mean_logprob


class Probability(Scorer):
    name = "prob"
    nonnegative = True

    def score(self, ctx: SearchContext, prefix: Sequence[int], segment: Sample) -> float:
        return math.exp(segment.mean_logprob)


class SelfCertainty(Scorer):
    name = "self-certainty"
    nonnegative = True

    def score(self, ctx: SearchContext, prefix: Sequence[int], segment: Sample) -> float:
        return sum(segment.certainty) / len(segment.certainty) if segment.certainty else 0.0


def returned_number(value: object, what: str, param: str | None = None) -> float:
    """What a user's ``what`` callable returned, held to being a finite number (bools and integers
    past a float's range refused): one line, not a TypeError or a NaN score later."""
    if not isinstance(value, Real) or isinstance(value, bool) or not finite(value):
        raise InvalidParameter(f"the {what} callable must return a finite number, got {value!r}", param=param)
    return float(value)


class CallableScorer(Scorer):
    name = "callable"

    def __init__(self, fn: Callable[[str], float]):
        self.fn = fn

    def score(self, ctx: SearchContext, prefix: Sequence[int], segment: Sample) -> float:
        return returned_number(self.fn(ctx.tokenizer.decode(list(prefix) + segment.tokens)), "scorer")


class Judge(Scorer):
    """LM-as-judge: the (same or another) model is asked, in the conversation that produced the
    answer, whether the answer is correct; the score is p(yes) / (p(yes) + p(no)), summing the
    single-token spellings yes/Yes/ yes/ Yes (and no alike). The judge must share the generating
    model's tokenizer (checked by vocabulary size) because it reads the same token ids.
    """

    name = "judge"
    nonnegative = True
    ANSWER_QUESTION = "Is this answer correct? Answer yes or no."
    STEP_QUESTION = "Is the last step correct? Answer yes or no."

    def __init__(self, model: LoadedModel | None = None, *, owned: bool = False):
        """``owned``: ``model`` was loaded for this scorer alone (a judge named by a request), so
        its cache is this request's to use; a model passed in may be decoding requests of its own."""
        self.model, self.owned = model, owned

    def score(self, ctx: SearchContext, prefix: Sequence[int], segment: Sample) -> float:
        return self._ask(ctx, prefix, segment, self.ANSWER_QUESTION)

    def score_step(self, ctx: SearchContext, prefix: Sequence[int], step: Sample) -> float:
        return self._ask(ctx, prefix, step, self.STEP_QUESTION)  # the first step too: it is not a whole answer

    def check(self, model: LoadedModel, request: Request | None = None) -> None:
        if self.model is not None and self.model.backend.info.vocab_size != model.backend.info.vocab_size:
            raise InvalidParameter("the judge model must share the generating model's tokenizer", param="judge_model")
        if request is None:
            return
        # the judge reads prompt + answer + its question: a request that fits the context may not
        # leave room for the question (a chat then drops its oldest exchanges, as for a long prompt)
        judge = self.model or model
        question = max(len(self._follow_up(judge, q)) for q in (self.ANSWER_QUESTION, self.STEP_QUESTION))
        limit = judge.backend.info.max_length
        if len(request.prompt_ids) + request.max_new_tokens + question > limit:
            raise PromptTooLong(f"prompt of {len(request.prompt_ids)} tokens + {request.max_new_tokens} new tokens + the "
                                f"judge's question of {question} tokens exceeds the judge model's context of {limit}")

    def _ask(self, ctx: SearchContext, prefix: Sequence[int], segment: Sample, question: str) -> float:
        self.check(ctx.model, ctx.request)  # again for a scorer used outside a search
        judge = self.model or ctx.model
        ids = ctx.prompt + list(prefix) + segment.tokens + self._follow_up(judge, question)
        logits = ctx.cache_for(judge, shared=not self.owned).fork(ids, 1)[0]
        return self.yes_share(judge, logits)

    @staticmethod
    def _follow_up(judge: LoadedModel, question: str) -> list[int]:
        """Ids that close the answer turn and ask ``question`` in the model's chat format."""
        tok = judge.tokenizer
        first = [{"role": "user", "content": "Q"}]
        base = tok.chat_prompt(first)
        full = tok.chat_prompt(first + [{"role": "assistant", "content": "A"}, {"role": "user", "content": question}])
        if base is not None and full is not None and full.startswith(base + "A"):
            return tok.encode(full[len(base) + 1 :])
        return tok.encode(f"\n\n{question}\nAnswer:")

    @staticmethod
    def yes_share(judge: LoadedModel, logits: torch.Tensor) -> float:
        probs = torch.softmax(logits.float(), dim=-1)

        def mass(words: tuple[str, ...]) -> float:
            ids = {ids[0] for w in words if len(ids := judge.tokenizer.encode(w)) == 1}
            return float(probs[list(ids)].sum()) if ids else 0.0

        yes, no = mass(("yes", "Yes", " yes", " Yes")), mass(("no", "No", " no", " No"))
        return yes / (yes + no) if yes + no > 0 else 0.5


_BUILT_IN: dict[str, type[Scorer]] = {s.name: s for s in (LogLikelihood, MeanLogprob, Probability, SelfCertainty)}
_BY_NAME: dict[str, type[Scorer]] = {**_BUILT_IN, Judge.name: Judge}
#: Every method with a scorer option takes the judge's model with it.
JUDGE_MODEL_OPTION = OptionSpec("judge_model", object, None, "model for the judge scorer (default: the same model)",
                                local=any_value)
SCORER_NAMES = tuple(_BY_NAME)
#: The scorers whose values can weigh votes (weighted-vote's choices).
NONNEGATIVE_SCORER_NAMES = tuple(name for name, scorer in _BY_NAME.items() if scorer.nonnegative)


def make_scorer(spec: str | Callable[[str], float] | Scorer, judge_model: LoadedModel | str | None = None) -> Scorer:
    """A scorer from a name, a callable or a Scorer instance; ``judge_model`` goes with ``"judge"``
    alone (beside any other scorer it would be ignored, so it is refused)."""
    if judge_model is not None and not (isinstance(spec, str) and spec == "judge"):
        shown = repr(spec) if isinstance(spec, str) else type(spec).__name__ if isinstance(spec, Scorer) else "a callable"
        raise InvalidParameter(f"judge_model is the judge scorer's model; with scorer={shown} it would be ignored "
                               "(give scorer=judge too)", param="judge_model")
    if isinstance(spec, Scorer):
        return spec
    if callable(spec):
        return CallableScorer(spec)
    if spec == "judge":
        if isinstance(judge_model, str):
            from ..models import load_model

            return Judge(load_model(judge_model), owned=True)
        if judge_model is not None and not isinstance(judge_model, LoadedModel):
            raise InvalidParameter(f"judge_model must be a model's name or a loaded model, got {judge_model!r:.80}",
                                   param="judge_model")
        return Judge(judge_model)
    if spec not in _BUILT_IN:
        raise InvalidParameter(f"scorer must be one of {', '.join(SCORER_NAMES)} or a callable, got {spec!r}")
    return _BUILT_IN[spec]()
