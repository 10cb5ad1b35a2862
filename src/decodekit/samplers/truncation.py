"""Temperature and the truncation samplers.

Shared conventions (the papers leave these open; each class says which apply):

* Every truncation sampler keeps the argmax token of its input, so no row is ever emptied.
* Rules that keep a *prefix* of the tokens sorted by probability (top-k, top-p, typical,
  adaptive top-k) also keep every token tied with the last one kept, so the kept set depends only
  on the distribution and never on token ids. Top-H is the exception (see its docstring).
* Probability thresholds keep tokens whose probability is ``>=`` the threshold.
* Probabilities are the softmax of the logits the processor receives, i.e. after earlier
  processors (tokens already at -inf have probability 0). Cumulative sums run in float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..options import check_real
from .base import LogitsProcessor, entropy, keep_only, sorted_probs
from .params import FLOAT32_MAX, SAMPLER_OPTIONS


def _mass_before(p: torch.Tensor) -> torch.Tensor:
    """Mass strictly before each position of a probability row (float64, non-decreasing)."""
    c = torch.cumsum(p, dim=-1, dtype=torch.float64)
    return torch.cat([torch.zeros_like(c[..., :1]), c[..., :-1]], dim=-1)


def _count(ok: torch.Tensor) -> torch.Tensor:
    """Number ``[B, 1]`` of True per row, at least 1 (for masks that are a prefix by construction)."""
    return ok.sum(dim=-1, keepdim=True).clamp(min=1)


def _prefix_len(ok: torch.Tensor) -> torch.Tensor:
    """Length ``[B, 1]`` of the leading run of True in each row, at least 1."""
    return (ok.long().cumprod(dim=-1).sum(dim=-1, keepdim=True)).clamp(min=1)


class Temperature(LogitsProcessor):
    """Temperature scaling: logits / T (T > 1 flattens, T < 1 sharpens). T must be > 0;
    ``Sampler.from_params`` maps ``temperature=0`` to greedy decoding instead."""

    pointwise = True

    def __init__(self, temperature: float) -> None:
        # T > 0 here, unlike the parameter's T >= 0: from_params turns 0 into greedy decoding
        self.temperature = check_real("temperature", temperature, 0.0, lo_open=True)
        # what the logits are divided by, within float32: a temperature below its smallest normal
        # number would be flushed to 0 (0 / 0), where the softmax already keeps only the largest
        # logits; one above its largest would be infinite (-inf / inf is NaN), where every allowed
        # token is already equally likely
        self._divisor = min(max(self.temperature, torch.finfo(torch.float32).tiny), FLOAT32_MAX)

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        logits = logits.float()
        scaled = logits / self._divisor
        # (one max per row: a third of the time, on the sampling path of every token)
        if self._divisor < 1.0:
            overflowed = ~scaled.amax(dim=-1, keepdim=True).isfinite()
            if bool(overflowed.any()):
                # a temperature this near 0 takes finite logits past float32's range, up to +inf or
                # (a row whose largest logit is negative) down to -inf everywhere; shifted by the row's
                # largest first they do not, and softmax(l / T) is the same distribution (as T -> 0:
                # the most likely tokens, evenly). Only those rows: a row's values never depend on the
                # others of its batch. A row whose largest is ±inf itself is left as it was.
                peak = logits.amax(dim=-1, keepdim=True)
                shift = torch.where(overflowed & peak.isfinite(), peak, torch.zeros_like(peak))
                scaled = (logits - shift) / self._divisor
        return scaled

    def describe(self) -> dict[str, Any]:
        return {"temperature": self.temperature}


class TopK(LogitsProcessor):
    """Top-k sampling (Fan et al., 2018, "Hierarchical Neural Story Generation"): keep the k
    highest logits. Ties at the k-th value are all kept, so a row may keep more than k tokens."""

    def __init__(self, top_k: int) -> None:
        self.top_k = SAMPLER_OPTIONS["top_k"].check(top_k)

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        k = min(self.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        return keep_only(logits.float(), logits >= kth)

    def describe(self) -> dict[str, Any]:
        return {"top_k": self.top_k}


class TopP(LogitsProcessor):
    """Nucleus sampling (Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration"):
    keep the smallest set of most probable tokens whose total mass is >= p. Tokens tied with the
    last one kept are kept too."""

    def __init__(self, top_p: float) -> None:
        self.top_p = SAMPLER_OPTIONS["top_p"].check(top_p)

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.top_p >= 1.0:  # every token (float32 probabilities summing past 1 would drop a tail)
            return logits
        probs, sp, _ = sorted_probs(logits)
        n = _count(_mass_before(sp) < self.top_p)  # mass before the token < p: still needed
        cutoff = sp.gather(-1, n - 1)
        return keep_only(logits.float(), probs >= cutoff)

    def describe(self) -> dict[str, Any]:
        return {"top_p": self.top_p}


class MinP(LogitsProcessor):
    """Min-p sampling (Nguyen et al., 2024, "Turning Up the Heat: Min-p Sampling for Creative and
    Coherent LLM Outputs"): keep tokens with p >= min_p * p_max."""

    def __init__(self, min_p: float) -> None:
        self.min_p = SAMPLER_OPTIONS["min_p"].check(min_p)

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        probs = torch.softmax(logits.float(), dim=-1)
        threshold = self.min_p * probs.max(dim=-1, keepdim=True).values
        return keep_only(logits.float(), probs >= threshold)

    def describe(self) -> dict[str, Any]:
        return {"min_p": self.min_p}


class TypicalP(LogitsProcessor):
    """Locally typical sampling (Meister et al., 2023, "Locally Typical Sampling", TACL).

    Tokens are ranked by how close their surprisal -log p is to the entropy H of the distribution;
    the smallest prefix of that ranking with total mass >= typical_p is kept (plus tokens tied in
    distance with the last one kept). The paper's set may leave out the most probable token; by
    default this library still keeps the argmax (its invariant for every truncation sampler), so
    the kept set is the typical set plus the argmax. ``keep_argmax=False`` gives the paper's set
    exactly (which always holds at least the most typical token).
    """

    def __init__(self, typical_p: float, *, keep_argmax: bool = True) -> None:
        self.typical_p = SAMPLER_OPTIONS["typical_p"].check(typical_p)
        self.keep_argmax = bool(keep_argmax)

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.typical_p >= 1.0:  # every token, as TopP(1.0)
            return logits
        x = logits.float()
        logp = torch.log_softmax(x, dim=-1)
        probs = logp.exp()
        dist = (-logp - entropy(probs)).abs()  # +inf for tokens already removed
        sd, si = torch.sort(dist, dim=-1, stable=True)
        n = _count(_mass_before(probs.gather(-1, si)) < self.typical_p)
        keep = dist <= sd.gather(-1, n - 1)
        if self.keep_argmax:
            return keep_only(x, keep)
        return x.masked_fill(~keep, float("-inf"))

    def describe(self) -> dict[str, Any]:
        return {"typical_p": self.typical_p}


class EpsilonCutoff(LogitsProcessor):
    """Epsilon sampling (Hewitt et al., 2022, "Truncation Sampling as Language Model
    Desmoothing"): keep tokens with p >= epsilon (and always the argmax)."""

    def __init__(self, epsilon: float) -> None:
        self.epsilon = SAMPLER_OPTIONS["epsilon"].check(epsilon)

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        probs = torch.softmax(logits.float(), dim=-1)
        return keep_only(logits.float(), probs >= self.epsilon)

    def describe(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon}


class EtaCutoff(LogitsProcessor):
    """Eta sampling (Hewitt et al., 2022, "Truncation Sampling as Language Model Desmoothing"):
    keep tokens with p >= min(eta, sqrt(eta) * exp(-H)), H the entropy (nats) of the distribution,
    and always the argmax."""

    def __init__(self, eta: float) -> None:
        self.eta = SAMPLER_OPTIONS["eta"].check(eta)

    def threshold(self, probs: torch.Tensor) -> torch.Tensor:
        """The per-row cutoff ``[B, 1]`` for probability rows ``probs``."""
        return torch.clamp(math.sqrt(self.eta) * torch.exp(-entropy(probs)), max=self.eta)

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        probs = torch.softmax(logits.float(), dim=-1)
        return keep_only(logits.float(), probs >= self.threshold(probs))

    def describe(self) -> dict[str, Any]:
        return {"eta": self.eta}


class TopNSigma(LogitsProcessor):
    """Top-nσ (Tang et al., 2024, "Top-nσ: Not All Logits Are You Need"): keep tokens whose logit
    is >= max − n·σ, with σ the population standard deviation of the row's logits. Tokens already
    at -inf are left out of the mean and σ. This is why ``Sampler.from_params`` runs it first among
    the truncation samplers: its statistics are meant over the (nearly) full vocabulary."""

    def __init__(self, top_n_sigma: float) -> None:
        self.top_n_sigma = SAMPLER_OPTIONS["top_n_sigma"].check(top_n_sigma)

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        x = logits.float()
        finite = torch.isfinite(x)
        n = finite.sum(dim=-1, keepdim=True).clamp(min=1)
        xf = x.masked_fill(~finite, 0.0)
        mean = xf.sum(dim=-1, keepdim=True) / n
        var = ((xf - mean) ** 2).masked_fill(~finite, 0.0).sum(dim=-1, keepdim=True) / n
        cutoff = x.max(dim=-1, keepdim=True).values - self.top_n_sigma * var.sqrt()
        return keep_only(x, x >= cutoff)

    def describe(self) -> dict[str, Any]:
        return {"top_n_sigma": self.top_n_sigma}


class TopH(LogitsProcessor):
    """Top-H decoding (Potraghloo et al., 2025, "Top-H Decoding: Adapting the Creativity and
    Coherence with Bounded Entropy in Text Generation", NeurIPS 2025, arXiv:2509.02510).

    The paper's greedy answer to entropy-constrained mass maximisation, with the stopping rule of
    the authors' reference code and Hugging Face's ``TopHLogitsWarper``: walk the tokens in
    descending probability, accumulating the *unnormalised* entropy terms −p log p, and keep the
    longest prefix whose sum is <= alpha · H(p) (the most probable token is always kept). The
    next token would push the sum past the bound. For uniform p over n tokens this keeps
    alpha · n of them. (Checking the *renormalised* entropy of the kept set instead keeps far
    fewer: n^alpha in that example.)

    Open details, chosen:

    * H(p) and the sum run over the whole vocabulary. Both reference implementations look only at
      the 100 most probable tokens, for speed (one vectorised sort makes that unnecessary here);
      Hugging Face also renormalises over those 100, so ``TopK(100)`` followed by ``TopH(alpha)``
      reproduces its warper where no tokens tie at the 100th place (``TopK`` keeps every tied one;
      Hugging Face's ``topk`` keeps 100 of them). The authors' code keeps the full-vocabulary probabilities over the
      top 100 instead (same result whenever the vocabulary has at most 100 tokens).
    * A sum equal to the bound is kept (``<=``, as in both references), up to float rounding.
    * Unlike the other prefix rules, ties at the boundary are broken by token id (lower id
      first), because keeping a tied token could break the entropy bound.
    * Tokens of probability 0 are never kept (their term is 0, so the sum alone would not stop).
    """

    def __init__(self, top_h: float) -> None:
        self.top_h = SAMPLER_OPTIONS["top_h"].check(top_h)

    @staticmethod
    def kept_count(sorted_p: torch.Tensor, alpha: float) -> torch.Tensor:
        """Number ``[B, 1]`` of leading tokens of descending rows ``sorted_p`` that top-H keeps."""
        p = sorted_p.double()
        partial = torch.cumsum(-torch.xlogy(p, p), dim=-1)  # unnormalised entropy of each prefix
        bound = alpha * partial[..., -1:]  # alpha * H(p)
        # the relative slack lets a sum that equals the bound in exact arithmetic count as equal
        return _prefix_len((partial <= bound * (1 + 1e-9)) & (p > 0))

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        _, sp, si = sorted_probs(logits)
        n = self.kept_count(sp, self.top_h)
        keep_sorted = torch.arange(sp.shape[-1], device=sp.device) < n
        keep = torch.zeros_like(keep_sorted).scatter(-1, si, keep_sorted)
        # (the prefix holds the argmax; not keep_only, which would keep every token tied with it)
        return logits.float().masked_fill(~keep, float("-inf"))

    def describe(self) -> dict[str, Any]:
        return {"top_h": self.top_h}


class AdaptiveTopK(LogitsProcessor):
    """Adaptive top-k by the KL Bregman decoder of Noarov et al., 2025, "Foundations of Top-k
    Decoding for Language Models" (arXiv:2505.19371).

    For the KL divergence their ℓ0-regularised objective reduces to cost(k) = −log S_k + λ·k,
    with S_k the mass of the k most probable tokens; they prove it is discretely convex in k.
    Its increment cost(k+1) − cost(k) = λ − log(1 + p_(k+1) / S_k) is non-decreasing, so the
    optimum is the smallest k with log(1 + p_(k+1) / S_k) <= λ (k = V if none). This stopping rule
    is our derivation from that objective. Tokens tied with the k-th are kept too.
    """

    def __init__(self, adaptive_k: float) -> None:
        self.adaptive_k = SAMPLER_OPTIONS["adaptive_k"].check(adaptive_k)

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        probs, sp, _ = sorted_probs(logits)
        p = sp.double()
        mass = torch.cumsum(p, dim=-1)
        nxt = torch.cat([p[..., 1:], torch.zeros_like(p[..., :1])], dim=-1)
        stop = torch.log1p(nxt / mass) <= self.adaptive_k  # always True in the last column
        k = stop.long().argmax(dim=-1, keepdim=True) + 1
        return keep_only(logits.float(), probs >= sp.gather(-1, k - 1))

    def describe(self) -> dict[str, Any]:
        return {"adaptive_k": self.adaptive_k}
