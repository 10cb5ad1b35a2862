"""``Sampler``: a chain of logits processors plus a seeded random generator."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidParameter
from ..models.kernels import argmax, exponential_race
from ..options import check_int, check_real, keyword_signature, parse_options
from .base import LogitsProcessor
from .params import SAMPLER_OPTIONS, SEED_LIMIT
from .penalties import (
    FrequencyPenalty,
    NoRepeatNGram,
    PresencePenalty,
    RepetitionPenalty,
)
from .truncation import (
    AdaptiveTopK,
    EpsilonCutoff,
    EtaCutoff,
    MinP,
    Temperature,
    TopH,
    TopK,
    TopNSigma,
    TopP,
    TypicalP,
)


#: The truncation samplers in the order they apply, each with its value that changes nothing (None: none).
TRUNCATION = (
    ("top_n_sigma", TopNSigma, None), ("top_k", TopK, None), ("top_p", TopP, 1.0),
    ("min_p", MinP, 0.0), ("typical_p", TypicalP, 1.0), ("epsilon", EpsilonCutoff, None),
    ("eta", EtaCutoff, None), ("top_h", TopH, None), ("adaptive_k", AdaptiveTopK, None),
)


def truncation_asked(params: dict[str, Any]) -> dict[str, Any]:
    """The truncation samplers ``params`` asks for (given, at a value that changes something)."""
    return {name: params[name] for name, _, noop in TRUNCATION if params.get(name) is not None and params[name] != noop}


#: What a draw from probabilities that are not finite, negative or all zero says: huge penalties take
#: float32 logits to infinity, which no draw can follow (a temperature near 0 does not: see Temperature).
UNSAMPLEABLE = ("no token can be sampled: the processed probabilities are not finite, are negative or sum to zero "
                "(a penalty too extreme for float32?)")


class Sampler:
    """Applies ``processors`` in order, then picks a token greedily or by sampling.

    ``seed`` (fresh OS entropy when None; the seed used is ``self.seed``) keys all randomness.
    The token at a position of a sequence (:meth:`pick_at`, :meth:`sample_at`: what plain,
    speculative and batched decoding use) is drawn with noise keyed by (seed, position), so it
    does not depend on the order of draws; other draws (:meth:`pick` of several rows,
    :meth:`sample_from`, :meth:`uniform`: rejection sampling's coin flips, resampling) come from
    ``self.generator``, a CPU ``torch.Generator`` seeded with it.
    Sampling moves the probabilities to the generator's device, so draws do not depend on where
    the logits live.
    """

    def broken_by(self, generated: list[int]) -> str | None:
        """The first processor's complaint about a finished request's tokens (see
        :meth:`LogitsProcessor.broken_by`), or None."""
        return next((why for p in self.processors if (why := p.broken_by(generated)) is not None), None)

    def forced(self, generated: list[int]) -> list[int]:
        """The tokens a processor forces after ``generated`` (:meth:`LogitsProcessor.forced`), or []."""
        return next((tokens for p in self.processors if (tokens := p.forced(generated))), [])

    @property
    def refuses_tokens(self) -> bool:
        """Whether a processor may refuse tokens outright (:meth:`allowed_prefix` below the whole)."""
        return any(p.refuses_tokens for p in self.processors)

    def allowed_prefix(self, generated: list[int], continuation: list[int]) -> int:
        """How many tokens of ``continuation``, in order, every processor allows after ``generated``
        (:meth:`LogitsProcessor.allowed_prefix`)."""
        return min((p.allowed_prefix(generated, continuation) for p in self.processors if p.refuses_tokens),
                   default=len(continuation))

    def prepare(self, rows: Sequence[Sequence[int]]) -> None:
        """Tell the processors that look ahead (:meth:`LogitsProcessor.prepare`) which rows' logits
        come next: each row's generated tokens, in the order of the rows."""
        for p in self.processors:
            if p.looks_ahead:
                p.prepare(rows)

    @property
    def looks_ahead(self) -> bool:
        """Whether a processor does work ahead (the decode loops skip :meth:`prepare` otherwise)."""
        return any(p.looks_ahead for p in self.processors)

    def __init__(self, processors: Sequence[LogitsProcessor] = (), *, greedy: bool = False,
                 seed: int | None = None) -> None:
        if not isinstance(greedy, bool):
            raise InvalidParameter(f"greedy must be true or false, got {greedy!r}")
        for p in processors:
            if not isinstance(p, LogitsProcessor):
                raise TypeError(f"processors must be LogitsProcessor instances, got {type(p).__name__}")
        self.processors: list[LogitsProcessor] = list(processors)
        self._greedy = greedy
        self.generator = torch.Generator()
        if seed is None:
            self.seed: int = self.generator.seed()
        else:
            self.seed = check_int("seed", seed, 0, SEED_LIMIT - 1)
            self.generator.manual_seed(self.seed)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_params(cls, **params: Any) -> "Sampler":
        """Build a validated sampler from flat parameters (:data:`SAMPLER_OPTIONS`; None = off).

        Order: repetition, frequency, presence penalties and no-repeat-n-gram; then temperature;
        then the truncation samplers top-nσ, top-k, top-p, min-p, typical, epsilon, eta, top-H,
        adaptive top-k (each one sees what the previous ones kept). ``temperature=0`` means
        greedy. Values that change nothing (temperature 1, top_p 1, min_p 0, typical_p 1,
        repetition_penalty 1, frequency/presence penalty 0) add no processor.
        ``penalty_window`` applies to the three penalties.
        """
        p = parse_options("the sampler", SAMPLER_OPTIONS, params, text=False)
        if p["greedy"] and params.get("temperature") not in (None, 0):
            raise InvalidParameter(f"greedy takes the most likely token, so temperature={p['temperature']:g} would be "
                                   "ignored; give one of them")
        window = p["penalty_window"]
        procs: list[LogitsProcessor] = []
        penalties = (("repetition_penalty", RepetitionPenalty, 1.0), ("frequency_penalty", FrequencyPenalty, 0.0),
                     ("presence_penalty", PresencePenalty, 0.0))
        for name, klass, noop in penalties:
            if p[name] is not None and p[name] != noop:
                procs.append(klass(p[name], window))
        if p["no_repeat_ngram_size"] is not None:
            procs.append(NoRepeatNGram(p["no_repeat_ngram_size"]))
        greedy = p["greedy"]
        if p["temperature"] == 0.0:
            greedy = True
        elif p["temperature"] != 1.0:
            procs.append(Temperature(p["temperature"]))
        asked = truncation_asked(p)
        procs += [klass(asked[name]) for name, klass, _ in TRUNCATION if name in asked]
        return cls(procs, greedy=greedy, seed=p["seed"])

    # help() and inspect show the table's keywords, not **params
    from_params.__func__.__signature__ = keyword_signature(SAMPLER_OPTIONS, "cls")  # type: ignore[attr-defined]

    def sampling(self, temperature: float) -> "Sampler":
        """This sampler made to sample, for methods that need diverse samples (best-of-N, voting).

        A greedy sampler (what every method but ``sample`` gets unless a temperature is given)
        becomes one that samples the same processed distribution at ``temperature``, inserted
        where :meth:`from_params` puts a temperature: after the penalties. A sampler that already
        samples, or ``temperature=0``, is returned as it is.
        """
        temperature = check_real("temperature", temperature, 0.0)
        if not self._greedy or temperature == 0:
            return self
        procs = list(self.processors)
        penalties = (RepetitionPenalty, FrequencyPenalty, PresencePenalty, NoRepeatNGram)
        at = max((i + 1 for i, p in enumerate(procs) if isinstance(p, penalties)), default=0)
        if temperature != 1.0:
            procs.insert(at, Temperature(temperature))
        return Sampler(procs, greedy=False, seed=self.seed)

    # ------------------------------------------------------------------ properties

    @property
    def is_greedy(self) -> bool:
        return self._greedy

    @property
    def needs_history(self) -> bool:
        return any(p.needs_history for p in self.processors)

    # ------------------------------------------------------------------ steps

    def process(self, logits: torch.Tensor, histories: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Processed float32 logits ``[B, V]`` (a new tensor; ``logits`` is not modified)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must have shape [batch, vocab], got {tuple(logits.shape)}")
        if self.needs_history and (histories is None or len(histories) != logits.shape[0]):
            got = "None" if histories is None else len(histories)
            raise ValueError(f"this sampler needs one history per batch row ({logits.shape[0]}), got {got}")
        out = logits.float()
        for proc in self.processors:
            out = proc(out, histories if proc.needs_history else ())
        return out.clone() if out is logits else out

    def probs(self, logits: torch.Tensor, histories: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The processed distribution ``[B, V]``; a one-hot at the argmax when greedy."""
        x = self.process(logits, histories)
        if self._greedy:
            return torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
        return torch.softmax(x, dim=-1)

    def pick(self, logits: torch.Tensor, histories: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Next token per row, LongTensor ``[B]`` on the logits' device."""
        x = self.process(logits, histories)
        if self._greedy:
            return x.argmax(dim=-1)
        return self.sample_from(torch.softmax(x, dim=-1))

    def pick_at(self, logits: torch.Tensor, position: int, history: Sequence[torch.Tensor] | None = None) -> int:
        """The token at ``position`` of a sequence, from its logits ``[V]``: the argmax when greedy,
        else :meth:`sample_at` of the processed distribution: the same token for the same seed,
        position and distribution, whatever was drawn before (``history``: one row, if needed)."""
        if self._greedy and not self.processors:  # nothing to process: no copy of the row to take
            return argmax(logits)
        token = self._chosen_before_the_mask(logits, position, history)
        if token is not None:
            return token
        only = self.processors[0] if self._greedy and len(self.processors) == 1 else None
        if only is not None and (not only.needs_history or (history is not None and len(history) == 1)):
            # one processor that may find its argmax without writing its output (a grammar's mask)
            token = only.greedy_choice(logits, history if only.needs_history else ())
            if token is not None:
                return token
        x = self.process(logits[None], history)[0]
        if self._greedy:
            return argmax(x)
        return self.sample_at(torch.softmax(x, dim=-1), position)

    def _chosen_before_the_mask(self, logits: torch.Tensor, position: int,
                                history: Sequence[torch.Tensor] | None) -> int | None:
        """:meth:`pick_at`'s token chosen before the first processor, where that one refuses tokens
        (a grammar's mask) and every later one is pointwise; None where the mask has to decide.

        A mask leaves the logits of the tokens it allows as they are, and a pointwise processor
        treats each token by its own logit, so over the allowed tokens the processed values are the
        same with the mask or without it. The argmax over every token is then the argmax over the
        allowed ones wherever the mask allows it (the first largest value of a row is the first
        largest of any part of it that holds it); so is the keyed race's winner, whose noise is fixed
        per token, up to the float32 rounding of the two softmaxes' normalisations (their ratio is
        the same for every allowed token): plain, speculative and batched decoding all choose here,
        so they agree token for token. llama.cpp's sampler asks its grammar in the same order. This
        saves the mask, most of a constrained step, wherever the model's own choice is allowed."""
        if not self.processors:
            return None
        first, rest = self.processors[0], self.processors[1:]
        if not first.refuses_tokens or not all(p.pointwise for p in rest):
            return None
        if (first.needs_history or any(p.needs_history for p in rest)) and (history is None or len(history) != 1):
            return None
        x = logits.float()
        for proc in rest:
            x = proc(x[None], history if proc.needs_history else ())[0]
        x = x.contiguous()
        if self._greedy:
            token = argmax(x)
        else:
            try:
                token = self.sample_at(torch.softmax(x, dim=-1), position)
            except InvalidParameter:  # nothing sampleable without the mask: the mask decides
                return None
        return token if first.surely_allows(token, history if first.needs_history else ()) else None

    def sample_at(self, probs: torch.Tensor, position: int) -> int:
        """One draw from ``probs`` ``[V]`` (non-negative, possibly unnormalised) for ``position``,
        by the exponential race: argmax p(v) / E(v) with E(v) ~ Exp(1) i.i.d., which is exactly
        p-distributed (the Gumbel-max trick: -log E is Gumbel). E depends only on (seed, position),
        never on what was drawn before, so the token at a position is fixed before any drafting:
        a speculative method reproduces plain sampling token for token, whatever it drafts and
        however its steps are timed; a draft drawn with the same E (a draft model at temperature)
        agrees with the target as often as the two distributions allow this coupling.

        E(v) = -log U(v), U(v) a hash of the key and v (:func:`..models.kernels.exponential_race`,
        which finds the winner without the logarithm of every U); the key is a splitmix64 hash of
        seed and position, so neighbouring positions get unrelated noise."""
        try:
            return exponential_race(probs, splitmix64(self.seed ^ splitmix64(position + 1)))
        except ValueError:
            raise InvalidParameter(UNSAMPLEABLE) from None

    def sample_from(self, probs: torch.Tensor) -> torch.Tensor:
        """One draw per row from (possibly unnormalised, non-negative) ``probs`` ``[..., V]``,
        using ``self.generator``; returns a LongTensor of shape ``probs.shape[:-1]``."""
        flat = probs.reshape(-1, probs.shape[-1]).to(self.generator.device, torch.float32)
        if bool((flat.sum(dim=-1) <= 0).any()) or not bool(torch.isfinite(flat).all()) or bool((flat < 0).any()):
            raise InvalidParameter(UNSAMPLEABLE)
        ids = torch.multinomial(flat, 1, generator=self.generator).view(probs.shape[:-1])
        return ids.to(probs.device)

    def uniform(self, n: int = 1) -> torch.Tensor:
        """``n`` independent U(0, 1) draws (float32, shape ``[n]``) from ``self.generator``."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"n must be a non-negative integer, got {n!r}")
        return torch.rand(int(n), generator=self.generator, device=self.generator.device)

    def describe(self) -> dict[str, Any]:
        """Active parameters: greedy flag, seed, processor order and each processor's settings."""
        out: dict[str, Any] = {"greedy": self._greedy, "seed": self.seed,
                               "processors": [type(p).__name__ for p in self.processors]}
        for p in self.processors:
            out.update(p.describe())
        return out

    def __repr__(self) -> str:
        return f"Sampler({self.processors!r}, greedy={self._greedy}, seed={self.seed})"


MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A 64-bit integer hash (Steele et al.'s SplitMix64 finaliser): nearby inputs, unrelated outputs.
    The result is kept below 2**63 (seeds and keys stay non-negative 64-bit integers everywhere)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) >> 1
