"""History-dependent processors: repetition, frequency and presence penalties, no-repeat-n-gram.

Histories are the prompt plus the generated ids of each row (a :class:`Histories`, which also
knows where the prompt ends). What counts follows each method's definition: the repetition
penalty and no-repeat-n-gram count the prompt too (CTRL's and Hugging Face's definition), the
frequency and presence penalties only the generated ids (OpenAI's and vLLM's definition: the
chat template alone holds several newlines, which must not be penalised before anything is
generated). The penalties take an optional recency window ``window`` (``penalty_window`` in
``Sampler.from_params``): only the last W ids of what they count matter, as in penalty decoding
(Zhu et al., 2023, "Penalty Decoding: Well Suppress the Self-Reinforcement Effect in Open-Ended
Text Generation").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import LogitsProcessor, count_history, generated_ids
from .params import FLOAT32_MAX, SAMPLER_OPTIONS


class _HistoryPenalty(LogitsProcessor):
    needs_history = True
    pointwise = True
    name = ""
    counts_prompt = True  # False: only the generated ids count

    def __init__(self, penalty: float, window: int | None = None) -> None:
        self.window = None if window is None else SAMPLER_OPTIONS["penalty_window"].check(window)
        self.penalty = self._check(penalty)

    def _check(self, penalty: float) -> float:
        return SAMPLER_OPTIONS[self.name].check(penalty)

    def counts(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        b, v = logits.shape
        rows = histories if self.counts_prompt else generated_ids(histories)
        return count_history(rows, b, v, logits.device, self.window)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {self.name: self.penalty}
        if self.window is not None:
            out["penalty_window"] = self.window
        return out


def saturated(penalised: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A finite logit that a penalty pushed past float32's range takes its largest value instead of
    ±inf (two infinite logits would give NaN probabilities); a masked (−inf) logit stays masked,
    whatever the penalty (−inf minus an infinite negative penalty would be NaN)."""
    return torch.where(torch.isfinite(logits), penalised.clamp(-FLOAT32_MAX, FLOAT32_MAX), logits)


class RepetitionPenalty(_HistoryPenalty):
    """Repetition penalty (Keskar et al., 2019, "CTRL: A Conditional Transformer Language Model for
    Controllable Generation"): for every token present in the (windowed) history, prompt included,
    a positive logit is divided by r and a negative one multiplied by r, however often the token
    occurred. r > 1 discourages repeats, r < 1 encourages them. The sign rule is Hugging Face's
    (as in llama.cpp and vLLM): CTRL divides every such logit by r, which raises a negative one."""

    name = "repetition_penalty"

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        x = logits.float()
        seen = self.counts(x, histories) > 0
        penalised = torch.where(x > 0, x / self.penalty, x * self.penalty)
        return torch.where(seen, saturated(penalised, x), x)


class FrequencyPenalty(_HistoryPenalty):
    """Frequency penalty (OpenAI API style, additive): logit −= penalty · count of the token among
    the (windowed) generated ids, the prompt excluded. Negative values encourage repeats."""

    name = "frequency_penalty"
    counts_prompt = False

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        x = logits.float()
        return saturated(x - self.penalty * self.counts(x, histories), x)


class PresencePenalty(_HistoryPenalty):
    """Presence penalty (OpenAI API style, additive): logit −= penalty for every token that occurs
    at least once among the (windowed) generated ids, the prompt excluded. Negative values
    encourage repeats."""

    name = "presence_penalty"
    counts_prompt = False

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        x = logits.float()
        return saturated(x - self.penalty * (self.counts(x, histories) > 0).float(), x)


class NoRepeatNGram(LogitsProcessor):
    """No-repeat-n-gram blocking (Paulus et al., 2018, "A Deep Reinforced Model for Abstractive
    Summarization"): ban every token that would complete an n-gram already present in the
    history, i.e. each token that followed an earlier occurrence of the last n−1 ids. n = 1 bans
    every token of the history. The whole history counts (no window). If the bans would remove
    every remaining token of a row, that row is left unchanged rather than emptied.
    """

    needs_history = True

    def __init__(self, no_repeat_ngram_size: int) -> None:
        self.n = SAMPLER_OPTIONS["no_repeat_ngram_size"].check(no_repeat_ngram_size)

    def banned(self, history: torch.Tensor) -> torch.Tensor:
        """Token ids that would complete a repeated n-gram after ``history``."""
        h = torch.as_tensor(history).reshape(-1).long()
        n = self.n
        if h.numel() < n:
            return h.new_empty(0)
        grams = h.unfold(0, n, 1)  # [L - n + 1, n]
        prefix = h[h.numel() - n + 1:]  # last n - 1 ids
        match = (grams[:, :-1] == prefix).all(dim=-1)
        return grams[match, -1]

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        x = logits.float()
        b, v = x.shape
        if histories is None or len(histories) != b:
            got = "None" if histories is None else len(histories)
            raise ValueError(f"expected {b} histories (one per batch row), got {got}")
        ban = torch.zeros(b, v, dtype=torch.bool, device=x.device)
        for row, history in enumerate(histories):
            ids = self.banned(history).to(x.device)
            if ids.numel():
                ban[row, ids] = True
        out = x.masked_fill(ban, float("-inf"))
        emptied = ~(out > float("-inf")).any(dim=-1, keepdim=True)
        return torch.where(emptied, x, out)

    def describe(self) -> dict[str, Any]:
        return {"no_repeat_ngram_size": self.n}
