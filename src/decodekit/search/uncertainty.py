"""Uncertainty signals returned with generations (``Generation.extra['uncertainty']``).

* ``phi_first`` (Gabriel, 2026, "The First Token Knows: Single-Decode Confidence for Hallucination
  Detection", arXiv:2605.05166): normalised entropy H(softmax(top-K logits)) / log K at the first
  content-bearing token of the answer (K = 10 by default). Content-bearing (our reading of the
  paper's rule, which depends on the template and tokenizer): the token writes text holding a
  letter or a digit (a byte-level token holding part of a character, of "О" or "东", writes that
  character); whitespace, punctuation and template/special tokens (which decode to nothing) are
  skipped. The answer starts at a character offset given by the caller (the last number for
  numeric answers; a task may skip a lead-in such as "The capital of X is"); tokens ending before
  it are skipped too. On a greedy decode it is the paper-style signal; on a
  sampled answer it is computed the same way. Low = confident.
* ``self_certainty``: mean over answer tokens of KL(U || p) (Kang et al., 2025, "Scalable Best-of-N
  Selection for Large Language Models via Self-Certainty"). High = confident.
* ``mean_logprob``, ``margin`` (mean top-1 minus top-2 probability): likelihood-based confidence.
* ``agreement``: fraction of N samples whose extracted answer equals the returned answer's
  (for self-consistency: the majority share; Wang et al., 2023).
* ``pc``: paraphrase consistency PC@k, the fraction of greedy answers to k paraphrases of the
  question that agree with the returned answer (needs the question text, so it is computed where
  the question is known: :func:`paraphrase_consistency`, ``decodekit eval --signals pc``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..engine.core import Request
from ..engine.stops import CHARACTER_BYTES, settled
from ..errors import InvalidParameter
from ..models import LoadedModel
from ..models.tokenizer import Tokenizer
from ..options import check_int
from .answers import Extractor
from .batch import SAMPLE_TEMPERATURE, Sample, SearchContext

# For each signal, +1 when a higher value means "more likely correct", -1 when lower does.
CONFIDENCE_DIRECTION: dict[str, int] = {
    "phi_first": -1,
    "self_certainty": 1,
    "mean_logprob": 1,
    "margin": 1,
    "agreement": 1,
    "pc": 1,
    "delta": 1,
    "value": 1,
}


def normalized_entropy(logits: Sequence[float] | torch.Tensor) -> float:
    """Entropy of softmax(logits) divided by log K (K = number of logits), in [0, 1]."""
    x = torch.as_tensor(logits, dtype=torch.float64)
    if x.numel() < 2:
        return 0.0
    p = torch.softmax(x, dim=-1)
    return float(-(torch.xlogy(p, p).sum()) / math.log(x.numel()))


def token_ends(tokens: Sequence[int], tokenizer: Tokenizer) -> list[int]:
    """End character offset of every token in ``decode(tokens)`` (non-decreasing)."""
    ends, last = [], 0
    for i in range(len(tokens)):
        last = max(last, len(tokenizer.decode(tokens[: i + 1])))
        ends.append(last)
    return ends


def token_text(tokens: Sequence[int], i: int, tokenizer: Tokenizer) -> str:
    """The text token ``i`` writes: its own, or, where it holds only part of a character (a
    byte-level token of "东" or "О" decodes on its own to U+FFFD), the character(s) it helps write,
    read with the few tokens around it that hold the rest of their bytes."""
    own = tokenizer.decode([tokens[i]])
    if "\ufffd" not in own:
        return own
    first = max(0, i - CHARACTER_BYTES + 1)  # a character's earlier bytes lie in these tokens
    before = settled(tokenizer.decode(list(tokens[first:i])))  # (less a character token i finishes)
    for end in range(i + 1, min(i + CHARACTER_BYTES, len(tokens)) + 1):
        through = tokenizer.decode(list(tokens[first:end]))
        if not through.endswith("\ufffd"):
            break
    return settled(through)[len(before) :]


def first_content_index(tokens: Sequence[int], tokenizer: Tokenizer, start_char: int = 0) -> int | None:
    """Index of the first token ending after ``start_char`` whose text (:func:`token_text`) holds a
    letter or digit."""
    end = 0  # as token_ends gives it, decoded only until a token ends after start_char (all later ones do)
    for i in range(len(tokens)):
        if end <= start_char and start_char > 0:
            end = max(end, len(tokenizer.decode(tokens[: i + 1])))
            if end <= start_char:
                continue
        if any(c.isalnum() for c in token_text(tokens, i, tokenizer)):
            return i
    return None


def phi_first(sample: Sample, tokenizer: Tokenizer, k: int | None = None, start_char: int = 0) -> float | None:
    """phi_first of a decoded sample (None when it has no content-bearing token)."""
    i = first_content_index(sample.tokens, tokenizer, start_char)
    if i is None or i >= len(sample.topk):
        return None
    top = sample.topk[i]
    return normalized_entropy(top[:k] if k else top)


def sample_signals(sample: Sample, tokenizer: Tokenizer, start_char: int = 0) -> dict[str, float | None]:
    """The signals one decoded answer carries by itself (``start_char``: where the answer begins)."""
    n = len(sample.tokens)
    return {
        "phi_first": phi_first(sample, tokenizer, start_char=start_char),
        "self_certainty": sum(sample.certainty) / n if n else None,
        "mean_logprob": sample.mean_logprob if sample.choices else None,
        "margin": sum(sample.margin) / n if n else None,
    }


def agreement(answer: str | None, answers: Sequence[str | None]) -> float | None:
    """Share of ``answers`` equal to ``answer`` (None when there is nothing to compare)."""
    if answer is None or not answers:
        return None
    return sum(a == answer for a in answers) / len(answers)


def sampled_agreement(
    model: LoadedModel, request: Request, answer: str | None, extract: Extractor, n: int = 8,
    temperature: float = SAMPLE_TEMPERATURE,
) -> dict[str, object]:
    """Sample ``n`` answers (one batch) and measure their agreement with ``answer``."""
    ctx = SearchContext(model, request)
    samples = ctx.decode(ctx.prompt, ctx.row_samplers(temperature), range(n), request.max_new_tokens)
    answers = [extract(s.text) for s in samples]
    return {"agreement": agreement(answer, answers), "answers": answers, "tokens_spent": ctx.spent}


def paraphrase_consistency(
    model: LoadedModel, prompts: Sequence[str], answer: str | None, extract: Extractor,
    request: Request, chat: bool = True,
) -> dict[str, object]:
    """PC@k: greedy answers to k paraphrased prompts, and the share agreeing with ``answer``.

    ``request`` supplies the sampler (made greedy here), stop strings and token limit.
    """
    answers, spent = [], 0
    for prompt in prompts:
        sub = Request(model.prompt_ids(prompt, chat=chat), request.sampler, request.max_new_tokens, request.stop)
        ctx = SearchContext(model, sub)
        sample = ctx.decode(ctx.prompt, ctx.greedy_rows(), [0], sub.max_new_tokens)[0]
        answers.append(extract(sample.text))
        spent += ctx.spent
    return {"pc": agreement(answer, answers), "answers": answers, "tokens_spent": spent}


#: Rephrasings of a question, none of them the question itself (PC@k asks k different ones).
PARAPHRASE_TEMPLATES = (
    "Please answer the following question.\n{q}",
    "I have a question for you: {q}",
    "Here is a question.\n\n{q}\n\nWhat is the answer?",
    "Answer this: {q}",
    "Question: {q}",
)


def paraphrases(question: str, k: int) -> list[str]:
    """``k`` distinct template paraphrases of a question (generic; tasks may supply better ones)."""
    return [template.format(q=question) for template in first_paraphrases(PARAPHRASE_TEMPLATES, k)]


def first_paraphrases(templates: Sequence[str], k: int) -> Sequence[str]:
    """The first ``k`` of a task's paraphrase templates; more than there are is refused (repeating
    a template would count one rephrasing's answer several times and inflate PC@k)."""
    check_int("paraphrases", k)
    if k > len(templates):
        raise InvalidParameter(f"paraphrases: {k} asked, but this task has {len(templates)} distinct ones", param="paraphrases")
    return templates[:k]
