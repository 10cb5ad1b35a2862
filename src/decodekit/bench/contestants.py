"""What the benchmark runs: a *contestant* turns prompt token ids into new tokens plus timings.

decodekit methods and external baselines (transformers, llama.cpp) share this interface, so
the runner treats them alike: same prompts, same token budget, same EOS rule, same clock.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine import Engine, method_spec

#: Used for the warm-up generation; deliberately not a benchmark question, so methods that
#: learn across requests (suffix trees, n-gram pools) are not primed with a question's answer.
WARMUP_PROMPT = "Say hello and introduce yourself in two sentences."


@dataclass
class RunResult:
    """One generation as the benchmark sees it. ``tokens`` exclude the EOS token."""

    tokens: list[int]
    text: str
    prefill_s: float
    decode_s: float
    finish_reason: str  # "eos" | "length" | "stop"
    forward_passes: int | None = None  # decode-time passes, prefill excluded; None when unknown
    mean_accepted: float | None = None  # tokens accepted per verification pass, when the method reports it
    extra: dict[str, Any] = field(default_factory=dict)


class Contestant(ABC):
    """A decodekit method or a baseline. ``token_exact`` says whether its token ids can be compared
    one-to-one with decodekit greedy (False for a differently quantised/tokenised runtime)."""

    name: str
    kind: str = "baseline"  # "decodekit" | "baseline"
    family: str = "baseline"
    lossless: bool | None = None
    token_exact: bool = True

    @abstractmethod
    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult: ...

    def fresh(self) -> None:
        """Forget what earlier runs taught it, as a new process would (nothing, unless it learns
        across requests)."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "family": self.family, "lossless": self.lossless, "token_exact": self.token_exact}


def json_safe(values: Mapping[str, Any]) -> dict[str, Any]:
    """Keep the JSON-serialisable scalar figures of a stats dict (methods may put anything there)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
            out[key] = value
        elif isinstance(value, float):
            out[key] = value if math.isfinite(value) else None
    return out


class MethodContestant(Contestant):
    """A registered decodekit method run through :class:`decodekit.engine.Engine` (greedy mode)."""

    kind = "decodekit"

    def __init__(self, engine: Engine, method: str, options: Mapping[str, Any] | None = None, *, name: str | None = None):
        spec = method_spec(method)  # raises UnknownMethod
        self.engine, self.method, self.options = engine, method, dict(options or {})
        self.base = engine.model.backend  # fresh() starts again from a clone of it
        self.name = name or method  # the label in reports; differs from the method when it is run twice
        # lossless here: its tokens are the greedy reference's (a lossless method that samples, such
        # as ``sample``, keeps plain sampling's tokens, not greedy's)
        samples = spec.sampling == "always" or (spec.sampling == "when-temperature" and bool(self.options.get("temperature")))
        self.family, self.lossless = spec.family, spec.lossless and not samples

    def fresh(self) -> None:
        """A clone of the backend it started with: same weights, an empty cross-request memory
        (suffix corpus, recycling table, acceptance records); the verify-cost table, a property
        of the machine, is read again from the disk cache, as a new process would."""
        from ..models import LoadedModel
        from ..speculative import prepare

        model = self.engine.model
        self.engine = Engine(LoadedModel(self.base.clone(), model.tokenizer, model.name))
        if self.family == "speculative":
            prepare(self.engine.model.backend)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        # every contestant reads its whole prompt, as the baselines do (llama.cpp's is reset, HF's
        # cache is new): not a prefix the engine kept from the last question or turn
        self.engine.model.backend.kept_ids = None
        g = self.engine.generate(list(prompt_ids), method=self.method, max_new_tokens=max_new_tokens, **self.options)
        accepted = g.stats.extra.get("mean_accepted")
        return RunResult(
            tokens=list(g.tokens),
            text=g.text,
            prefill_s=g.stats.prefill_s,
            decode_s=g.stats.decode_s,
            finish_reason=g.finish_reason,
            forward_passes=g.stats.forward_passes,
            mean_accepted=float(accepted) if isinstance(accepted, (int, float)) else None,
            extra=json_safe({k: v for k, v in g.stats.extra.items() if k != "mean_accepted"}),
        )


class Stopwatch:
    """Splits a streamed generation into prefill (start -> first new token) and decode (the rest)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def first_token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def split(self) -> tuple[float, float]:
        end = time.perf_counter()
        first = self.first if self.first is not None else end
        return first - self.start, end - first


def cut_at_eos(tokens: list[int], eos: frozenset[int], max_new_tokens: int) -> tuple[list[int], str]:
    """Drop everything from the first EOS on; the finish reason follows decodekit's loop."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i], "eos"
    return tokens[:max_new_tokens], "length"
