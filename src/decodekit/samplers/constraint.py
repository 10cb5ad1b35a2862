"""Structured decoding: a JSON Schema, a regular expression, a list of choices or a grammar as a
token mask, computed by llguidance (Microsoft's Earley-parser-based mask engine, MIT).

:class:`Constraint` says what the output must match; :func:`constraint_processor` compiles it
for a tokenizer into a :class:`ConstrainedTokens` processor, which the sampler runs first: every
other processor (penalties, temperature, truncation) and the final choice see the allowed tokens
only, and an end-of-sequence token is allowed exactly where the grammar accepts.

The processor follows each row's own history: it keeps one matcher, and before a mask it rolls
the matcher back to the longest prefix it shares with the row's generated tokens and consumes the
rest. So a row of a verification tree is masked for its own path, and speculative decoding stays
token-identical to constrained plain decoding (a drafted token the grammar refuses gets no
probability from its parent's mask, so it is never accepted). Where the grammar fixes the text that
comes next (a JSON key, a literal), :meth:`ConstrainedTokens.forced` gives its tokens, which
speculative decoding verifies as a free draft (:mod:`decodekit.speculative.loop`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InvalidParameter
from .base import NEG_INF, LogitsProcessor, generated_ids

KINDS = ("json", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match. ``kind``: ``json`` (any JSON object), ``json_schema``
    (``value``: a schema, as a dict or JSON text), ``regex`` (``value``: a pattern the whole output
    matches), ``choice`` (``value``: the allowed strings), ``grammar`` (``value``: a Lark grammar,
    as llguidance accepts it)."""

    kind: str
    value: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParameter(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice" and (not isinstance(self.value, (list, tuple)) or not self.value
                                      or not all(isinstance(c, str) and c for c in self.value)):
            raise InvalidParameter(f"a choice constraint needs a non-empty list of non-empty strings, got {self.value!r}")
        if self.kind in ("regex", "grammar") and (not isinstance(self.value, str) or not self.value):
            raise InvalidParameter(f"a {self.kind} constraint needs a non-empty string, got {self.value!r}")

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (InvalidParameter for a schema that is not JSON)."""
        from llguidance import LLMatcher

        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            schema = self.value
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as err:
                    raise InvalidParameter(f"the JSON schema is not valid JSON ({err})") from None
            if not isinstance(schema, dict):
                raise InvalidParameter(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
            return LLMatcher.grammar_from_json_schema(schema)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.value))
        return LLMatcher.grammar_from_lark(self.value)

    @classmethod
    def coerce(cls, value: "Constraint | dict | None") -> "Constraint | None":
        """A constraint from itself or a one-key dict such as ``{"regex": "[0-9]+"}``."""
        if value is None or isinstance(value, Constraint):
            return value
        if isinstance(value, dict) and len(value) == 1:
            (kind, spec), = value.items()
            return cls(kind, spec)
        raise InvalidParameter(f"constraint must be a Constraint or a dict with one of {', '.join(KINDS)}, got {value!r}")


class ConstrainedTokens(LogitsProcessor):
    """Logits of tokens the grammar does not allow after a row's generated tokens become -inf."""

    needs_history = True

    def __init__(self, matcher, vocab_size: int, constraint: Constraint):
        self.matcher, self.vocab_size, self.constraint = matcher, vocab_size, constraint
        self.consumed: list[int] = []  # the generated tokens the matcher has taken, in order

    def _follow(self, generated: list[int]) -> bool:
        """Bring the matcher to ``generated``; False if the grammar refuses one of its tokens."""
        if generated[: len(self.consumed)] == self.consumed:  # the common case: the row only grew
            shared = len(self.consumed)
        else:
            shared = 0
            for a, b in zip(self.consumed, generated):
                if a != b:
                    break
                shared += 1
        if shared < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - shared)
            del self.consumed[shared:]
        rest = generated[shared:]
        if rest:
            if self.matcher.validate_tokens(rest) < len(rest):
                return False
            self.matcher.consume_tokens(rest)
            self.consumed.extend(rest)
        return not self.matcher.is_error()

    def mask(self) -> torch.Tensor:
        """Bool ``[vocab_size]``: the tokens allowed next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():  # e.g. a mask computation that ran out of its budget: say so, never sample unmasked
            raise RuntimeError(f"structured decoding failed: {self.matcher.get_error()}")
        allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little").view(np.bool_))  # bit i: token i
        if allowed.numel() < self.vocab_size:  # tokens the grammar's tokenizer does not know
            allowed = torch.cat([allowed, torch.zeros(self.vocab_size - allowed.numel(), dtype=torch.bool)])
        return allowed[: self.vocab_size]

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        rows = []
        for row, generated in enumerate(generated_ids(histories)):
            if self._follow(generated.tolist()):
                rows.append(torch.where(self.mask()[: logits.shape[1]], logits[row], NEG_INF))
            else:  # a path the grammar refuses (a rejected draft): its parent's mask already gave it
                rows.append(logits[row])  # no probability, so what this row holds is never used
        return torch.stack(rows)

    def describe(self) -> dict[str, Any]:
        return {"constraint": self.constraint.kind}

    def forced(self, generated: list[int]) -> list[int]:
        """llguidance's fast-forward tokens after ``generated``: the canonical tokens of the text the
        grammar fixes next (a JSON key, a literal). The mask may still allow another spelling of that
        text, so they are a draft to verify, not tokens to commit unseen."""
        if not self._follow(list(generated)):
            return []
        return list(self.matcher.compute_ff_tokens())

    def broken_by(self, generated: list[int]) -> str | None:
        if self._follow(list(generated)):
            return None
        return f"the output breaks its {self.constraint.kind.replace('_', ' ')} constraint"



def checked_grammar(constraint: Constraint | dict, lltokenizer=None) -> tuple[Constraint, str]:
    """``constraint`` and its llguidance grammar, checked (against ``lltokenizer`` when given, which
    also catches what a vocabulary cannot spell); an invalid schema, pattern or grammar is one
    InvalidParameter line."""
    from llguidance import LLMatcher

    constraint = Constraint.coerce(constraint)
    grammar = constraint.grammar()
    error = LLMatcher.validate_grammar(grammar, lltokenizer).strip()
    if error:
        raise InvalidParameter(f"invalid {constraint.kind.replace('_', ' ')} constraint: {error.splitlines()[0]}")
    return constraint, grammar


def constraint_processor(constraint: Constraint | dict, tokenizer, vocab_size: int) -> ConstrainedTokens:
    """Compile ``constraint`` for ``tokenizer`` (a :class:`..models.tokenizer.Tokenizer`); an invalid
    schema, pattern or grammar is one InvalidParameter line."""
    from llguidance import LLMatcher

    lltokenizer = tokenizer.grammar_tokenizer()
    constraint, grammar = checked_grammar(constraint, lltokenizer)
    matcher = LLMatcher(lltokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidParameter(f"invalid {constraint.kind.replace('_', ' ')} constraint: {matcher.get_error()}")
    return ConstrainedTokens(matcher, vocab_size, constraint)
