"""Structured decoding: a JSON Schema, a regular expression, a list of choices or a grammar as a
token mask, computed by llguidance (Microsoft's Earley-parser-based mask engine, MIT).

:class:`Constraint` says what the output must match; :func:`constraint_processor` compiles it
for a tokenizer into a :class:`ConstrainedTokens` processor, which the sampler runs first: every
other processor (penalties, temperature, truncation) and the final choice see the allowed tokens
only, and an end-of-sequence token is allowed exactly where the grammar accepts.

The processor follows each row's own history (:class:`MatcherPaths`: a matcher per row, moved
only forward, copied where rows branch). So a row of a verification tree is masked for its own
path, and speculative decoding stays
token-identical to constrained plain decoding (a drafted token the grammar refuses gets no
probability from its parent's mask, so it is never accepted; the speculative loop drops such drafts
before verifying, :meth:`ConstrainedTokens.allowed_prefix`). Where the grammar fixes the text that
comes next (a JSON key, a literal), :meth:`ConstrainedTokens.forced` gives its tokens, which
speculative decoding verifies as a free draft (:mod:`decodekit.speculative.loop`).
"""

from __future__ import annotations

import json
import math
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from ..errors import InvalidParameter
from ..models.backend import common_prefix
from ..models.kernels import mask_logits, masked_argmax
from ..machine import usable_cores
from ..models.threads import GOVERNOR
from ..models.tokenizer import grammar_error_line, matcher_error_line
from .base import LogitsProcessor, generated_lists

KINDS = ("json", "json_schema", "regex", "choice", "grammar")


#: Schema keywords whose numbers bound or spell the output's values, or bound its sizes.
NUMERIC_KEYWORDS = ("const", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                    "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                    "minContains", "maxContains")
EXACT_INTEGERS = 2**53  # float64 holds every integer up to this, and not all beyond


def inexact_number(schema: Any, at: str = "") -> str | None:
    """Where ``schema`` bounds or spells a value with a number a float64 does not hold exactly (an
    integer beyond 2**53, an infinity from an overflowing literal such as 1e400), as
    "KEYWORD at PATH holds N"; None when it has none. llguidance rounds such numbers, and an output
    decoded under the rounded bound would break the schema the user gave."""
    def bad(value: Any) -> Any:
        if isinstance(value, bool):
            return None
        if isinstance(value, int) and abs(value) > EXACT_INTEGERS:
            return value
        if isinstance(value, float) and not math.isfinite(value):
            return value
        for inner in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
            if (found := bad(inner)) is not None:
                return found
        return None

    if isinstance(schema, dict):
        for key, value in schema.items():
            if isinstance(value, (dict, list)):  # a subschema (a property may be named "const" too)
                if (found := inexact_number(value, f"{at}/{key}")) is not None:
                    return found
            if key in NUMERIC_KEYWORDS and (found := bad(value)) is not None:
                return f"{key} at {at or '/'} holds {found}"
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            if (found := inexact_number(value, f"{at}/{i}")) is not None:
                return found
    return None


#: llguidance's own schema options (``x-guidance``) that let its grammar break the schema: what a
#: constraint refuses (its whitespace options change only the spacing of valid JSON).
LOOSENING_OPTIONS = frozenset({"lenient", "coerce_one_of", "item_separator", "key_separator"})


def schema_refusal(schema: dict | bool, text: str) -> str | None:
    """Why ``text`` is no JSON value valid against ``schema`` (``jsonschema``), or None. What
    llguidance's grammar for a schema is known to let through: an exclusive bound's own value (0 for
    ``exclusiveMinimum: 0`` below a maximum under 1), ``-0`` below an exclusive 0. Left to the
    grammar: ``multipleOf``, which floating point cannot judge (0.57 is no multiple of 0.01 in
    binary), and ``format``, of which the checker knows few."""
    import jsonschema

    try:
        value = json.loads(text, parse_int=whole_number)
    except ValueError:
        return "it is not JSON"
    errors = jsonschema.validators.validator_for(schema)(schema).iter_errors(value)
    try:
        return next((f"{error.message} (at {error.json_path})" for error in errors
                     if error.validator not in ("multipleOf", "format")), None)
    except ValueError:  # a message quoting an integer past Python's digits for a str (jsonschema's repr)
        return "it breaks the schema at an integer too long to quote"


#: Digits Python converts between str and int in one piece (sys.int_max_str_digits' default is 4300).
DIGITS_AT_ONCE = 4000


def whole_number(digits: str) -> int:
    """A JSON integer of any length: ``int()`` refuses a string of more than 4300 digits (Python's
    guard against slow conversions), which ``json.loads`` would report as no JSON at all."""
    sign, digits = (-1, digits[1:]) if digits.startswith("-") else (1, digits)
    value = 0
    for start in range(0, len(digits), DIGITS_AT_ONCE):
        piece = digits[start:start + DIGITS_AT_ONCE]
        value = value * 10 ** len(piece) + int(piece)
    return sign * value


def check_utf8(text: str, kind: str) -> None:
    """A constraint's text must be UTF-8: a lone surrogate (from undecodable bytes, or a JSON
    ``"\\ud800"``) would reach llguidance as no text, or as another."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidParameter(f"a {kind.replace('_', ' ')} constraint is not valid UTF-8 text "
                               f"(undecodable character at position {err.start} of {text!r:.80})") from None


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
        if self.kind == "json" and self.value is not None:
            raise InvalidParameter(f"a json constraint means any JSON object and takes no value; for a schema use "
                                   f"json_schema, got {self.value!r:.80}")
        if self.kind in ("regex", "grammar") and (not isinstance(self.value, str) or not self.value):
            raise InvalidParameter(f"a {self.kind} constraint needs a non-empty string, got {self.value!r}")
        for text in self.value if self.kind == "choice" else [self.value] if isinstance(self.value, str) else []:
            check_utf8(text, self.kind)

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (InvalidParameter for a schema that is not JSON)."""
        from llguidance import LLMatcher

        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            try:
                return self._schema_grammar()
            except RecursionError:  # json's readers and writers, and inexact_number, recurse
                raise InvalidParameter("the JSON schema is nested too deeply") from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.value))
        return LLMatcher.grammar_from_lark(self.value)

    def schema(self) -> dict | bool:
        """A json_schema constraint's schema, read and checked (InvalidParameter where it is no schema)."""
        schema = self.value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise InvalidParameter(f"the JSON schema is not valid JSON ({err})") from None
        if not isinstance(schema, (dict, bool)):  # true: any JSON value; false: none
            raise InvalidParameter(f"a JSON schema must be a JSON object or a boolean, got {type(schema).__name__}")
        if schema is False:
            raise InvalidParameter("the JSON schema false allows no value at all")
        options = schema.get("x-guidance") if isinstance(schema, dict) else None
        changing = sorted(set(options) & LOOSENING_OPTIONS) if isinstance(options, dict) else []
        if changing:
            raise InvalidParameter(f"the JSON schema's x-guidance option {changing[0]} lets llguidance write what the "
                                   f"schema refuses (or no JSON at all); leave it out")
        return schema

    def _schema_grammar(self) -> str:
        """The grammar of a json_schema constraint, its schema read and checked first."""
        from llguidance import LLMatcher

        schema = self.schema()
        check_utf8(json.dumps(schema, ensure_ascii=False), self.kind)  # a "\\ud800" of its JSON text, or a dict's
        inexact = inexact_number(schema)
        if inexact is not None:
            raise InvalidParameter(f"the JSON schema's {inexact}: llguidance reads a schema's numbers as 64-bit "
                                   f"floats, so its output could break the schema")
        try:
            return LLMatcher.grammar_from_json_schema(schema)
        except ValueError as err:
            raise InvalidParameter(f"invalid json schema constraint: {err}") from None

    @classmethod
    def coerce(cls, value: "Constraint | dict | None") -> "Constraint | None":
        """A constraint from itself or a one-key dict such as ``{"regex": "[0-9]+"}``."""
        if value is None or isinstance(value, Constraint):
            return value
        if isinstance(value, dict) and len(value) == 1:
            (kind, spec), = value.items()
            return cls(kind, spec)
        raise InvalidParameter(f"constraint must be a Constraint or a dict with one of {', '.join(KINDS)}, got {value!r}")


def spare_cores() -> int:
    """The cores the forward passes leave free."""
    return max(0, usable_cores() - GOVERNOR.full_count())


class Pending:
    """A computation handed to :class:`MaskWorkers`: its outcome, once there is one."""

    def __init__(self) -> None:
        self.outcome: tuple[bool, Any] | None = None  # (True, result) or (False, exception), once done
        self.woken: queue.SimpleQueue = queue.SimpleQueue()  # one item, put once the outcome is there

    def result(self) -> Any:
        """Wait for the outcome (an interrupted wait may be repeated: the outcome stays here)."""
        if self.outcome is None:
            self.woken.get()
        done, value = self.outcome
        if not done:
            raise value
        return value


class MaskWorkers:
    """The threads that compute masks ahead, for every request of the process: as many as the forward
    passes leave cores free (at least one), however many requests are constrained.

    Work and wake-ups pass through ``queue.SimpleQueue`` only, whose ``put`` and ``get`` are single C
    calls, and an outcome is kept where a repeated wait finds it: a KeyboardInterrupt in the caller
    can neither leave a lock the workers need held (a ``ThreadPoolExecutor``'s ``submit`` can, and
    every later mask then waits for ever) nor lose an outcome."""

    def __init__(self, threads: int):
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._serve, name=f"decodekit-mask-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Pending:
        pending = Pending()
        self.work.put((fn, args, pending))
        return pending

    def _serve(self) -> None:
        while True:
            fn, args, pending = self.work.get()
            try:
                pending.outcome = (True, fn(*args))
            except BaseException as err:  # handed to the caller, who raises it
                pending.outcome = (False, err)
            pending.woken.put(None)


@cache
def mask_workers() -> MaskWorkers:
    return MaskWorkers(max(1, spare_cores()))


class MatcherPaths:
    """llguidance matchers at the rows a processor is asked about (a batch's rows, a verification
    tree's paths): each row's own, moved only forward once it has computed a mask.

    Why not one matcher rolled back from row to row: llguidance keeps the last mask it computed,
    keyed by the parser's row index and lexer state, and ``rollback`` leaves that entry in place
    (llguidance 1.5.1 to at least 1.9.1). A row reached on another path with the same index and
    state then gets the earlier path's mask: a sibling's allowed tokens, and an output that breaks
    its schema. Rolling back is safe for a matcher that has never computed a mask: the ``anchor``
    here, which moves to wherever a row branches off the kept paths and is copied there
    (``deep_copy``, which keeps no mask either)."""

    #: Matchers kept at most (a batch's rows each move on from their own; a long output's matcher
    #: holds parser state for every token, so the paths of rows no longer asked about are dropped).
    KEPT = 64
    #: How many of the kept paths' lengths a row is looked up at before it branches from the anchor.
    LOOKED_BACK = 8

    def __init__(self, matcher, known: Callable[[list[int]], list[int]]):
        self.anchor, self.anchor_tokens = matcher, []  # never asked for a mask
        self.known = known  # the tokens a matcher may be given (up to the first the grammar's vocabulary lacks)
        self.paths: OrderedDict[tuple[int, ...], Any] = OrderedDict()  # tokens taken -> the matcher there
        self.call = 0  # the processor's calls so far (each asks about one pass's rows)
        self.used: dict[tuple[int, ...], int] = {}  # the call that last asked about each kept path

    def matchers(self) -> list:
        return [self.anchor, *self.paths.values()]

    def next_call(self) -> None:
        """A new pass's rows are asked about: the paths neither this call's rows nor the last's
        asked about are dropped (rows grow from the last pass's rows; a dropped one that is asked
        about again branches from the anchor, at the cost of a copy)."""
        self.call += 1
        for key in [k for k, call in self.used.items() if call < self.call - 1]:
            del self.paths[key], self.used[key]

    def touch(self, tokens: tuple[int, ...]) -> None:
        """``tokens``' path is asked about again (its mask was known): kept for the next call."""
        if tokens in self.used:
            self.used[tokens] = self.call

    def at(self, tokens: list[int]) -> tuple[Any, int]:
        """A matcher brought along ``tokens`` as far as the grammar takes them, and how many it took.
        The matcher is the path's own: the caller may compute its mask, never roll it back."""
        key = tuple(tokens)
        if key in self.paths:
            self.paths.move_to_end(key)
            self.used[key] = self.call
            return self.paths[key], len(key)
        # the longest kept path the row continues, among the few longest kept below its length (a row
        # grows from its own path, a tree's from a path a few tokens back); further back, the anchor
        lengths = sorted({len(k) for k in self.paths if len(k) < len(key)}, reverse=True)[: self.LOOKED_BACK]
        start = next((n for n in lengths if key[:n] in self.paths), None)
        if start is not None:  # moved on, not copied
            matcher = self.paths.pop(key[:start])
            del self.used[key[:start]]
        else:
            start = self._move_anchor(tokens)
            matcher = self.anchor.deep_copy()
        rest = self.known(tokens[start:])
        taken = start + (matcher.try_consume_tokens(rest) if rest else 0)  # stops before the first token refused
        self.paths[key[:taken]], self.used[key[:taken]] = matcher, self.call
        while len(self.paths) > self.KEPT:
            del self.used[self.paths.popitem(last=False)[0]]
        return matcher, taken

    def _move_anchor(self, tokens: list[int]) -> int:
        """Bring the anchor along ``tokens`` as far as the grammar takes them (rolled back to where
        they part, then forward); how many of them it holds."""
        shared = common_prefix(self.anchor_tokens, tokens)
        if shared < len(self.anchor_tokens):
            self.anchor.rollback(len(self.anchor_tokens) - shared)
            del self.anchor_tokens[shared:]
        rest = self.known(tokens[shared:])
        taken = self.anchor.try_consume_tokens(rest) if rest else 0
        self.anchor_tokens.extend(rest[:taken])
        return len(self.anchor_tokens)


#: How many allowed tokens an output that broke its constraint has checked one by one for a dead end.
DEAD_END_CHECKS = 64


class ConstrainedTokens(LogitsProcessor):
    """Logits of tokens the grammar does not allow after a row's generated tokens become -inf.

    Where a core is left free by the forward pass's threads, the masks are computed ahead
    (:meth:`prepare`), on a background thread, while the pass that gives the logits runs: the
    decode loop knows each row's tokens before the pass, and llguidance releases the GIL while it
    computes a mask (vLLM and SGLang overlap the mask with the pass likewise). Where the pass uses
    every core, a third thread only takes a core from it for a scheduler slice at a time, which
    measured slower than computing the mask between passes (docs/BENCHMARKS.md). A mask computed
    ahead is the one the row's matcher would compute then (:class:`MatcherPaths`: the same paths,
    brought to the same tokens), so the output does not depend on whether, or when, it was prepared."""

    needs_history = True
    refuses_tokens = True

    @property
    def looks_ahead(self) -> bool:  # type: ignore[override]
        return spare_cores() > 0

    def __init__(self, matcher, constraint: Constraint, vocab: int | None = None, special: dict[int, str] | None = None,
                 eos: frozenset[int] = frozenset(), lltokenizer=None):
        self.constraint = constraint
        self.vocab = vocab  # the grammar tokenizer's size: an id past it puts llguidance's matcher in error
        self.lltokenizer = lltokenizer  # llguidance's view of the vocabulary (for messages), where given
        self.paths = MatcherPaths(matcher, self._known)
        # llguidance spells text with special tokens too ("<|im_end|>"), which decode to no text: a
        # mask never allows one, but for an end-of-sequence token where the grammar accepts
        self.special, self.eos = dict(special or {}), eos
        self._special_bits: np.ndarray | None = None  # bit set: a special token (llguidance's layout)
        self._ahead: Pending | None = None  # the masks being computed for the rows given to prepare()
        self._ready: dict[tuple[int, ...], np.ndarray | None] = {}  # the last prepare()'s masks

    def prepare(self, rows: Sequence[Sequence[int]]) -> None:
        ready = self._settle()  # the matchers serve one computation at a time
        self._ahead = mask_workers().submit(self._bitmasks, [list(r) for r in rows], ready)

    def _settle(self) -> dict[tuple[int, ...], np.ndarray | None]:
        """The masks the last :meth:`prepare` asked for (row's tokens -> bitmask, or None for a row
        the grammar refuses), once the matcher is free again: they serve every call until the next
        prepare (a verification asks for its rows one at a time, as its walk reaches them)."""
        if self._ahead is not None:
            ahead = self._ahead
            try:
                self._ready = ahead.result()  # (an interrupted wait leaves it to be waited for next time)
            finally:
                if ahead.outcome is not None:
                    self._ahead = None
        return self._ready

    def _bitmasks(self, rows: list[list[int]], known: dict) -> dict[tuple[int, ...], np.ndarray | None]:
        """Each row's bitmask (None where the grammar refuses the row), from ``known`` or computed."""
        self.paths.next_call()
        done = {}
        for row in rows:
            key = tuple(row)
            if key in known:
                done[key] = known[key]
                self.paths.touch(key)
            else:
                matcher = self._follow(row)
                done[key] = None if matcher is None else self._bitmask(matcher)
        return done

    def _follow(self, generated: list[int]) -> Any:
        """The matcher of the row ``generated``; None if the grammar refuses one of its tokens."""
        matcher, taken = self.paths.at(list(generated))
        self._check(matcher)
        return matcher if taken == len(generated) else None

    @staticmethod
    def _check(matcher) -> None:
        """An error of the matcher's own (a grammar too complex for its limits, a computation out of
        its budget): one line, never a row taken as refused and left unmasked. The matcher's error
        state lasts, so every later use would fail alike."""
        if matcher.is_error():
            raise InvalidParameter(f"structured decoding failed: {matcher_error_line(matcher.get_error())}",
                                   param="constraint")

    def _known(self, tokens: list[int]) -> list[int]:
        """``tokens`` up to the first the grammar's tokenizer does not have (a drafted id of a model's
        padded vocabulary): llguidance's matcher goes into its error state on one, even to validate it."""
        if self.vocab is None:
            return tokens
        return next((tokens[:i] for i, t in enumerate(tokens) if not 0 <= t < self.vocab), tokens)

    def _bitmask(self, matcher) -> np.ndarray:
        """The tokens allowed next after ``matcher``'s row, as llguidance's bitmask (bit i of byte
        i // 8: token i)."""
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        self._check(matcher)  # e.g. a mask computation that ran out of its budget: say so, never sample unmasked
        return self._without_special(bits, matcher)

    def _without_special(self, bits: np.ndarray, matcher) -> np.ndarray:
        """``bits`` less the special tokens, but for the end-of-sequence ones where the grammar
        accepts; a mask left with nothing is an error (the text can only go on as a special
        token's, which no output holds)."""
        if not self.special:
            return bits
        if self._special_bits is None or len(self._special_bits) != len(bits):
            marks = np.zeros(8 * len(bits), dtype=np.uint8)
            marks[[t for t in self.special if t < len(marks)]] = 1
            self._special_bits = np.packbits(marks, bitorder="little")
        hit = bits & self._special_bits
        if not hit.any():
            return bits
        kept = bits & ~self._special_bits
        accepting = matcher.is_accepting()
        for t in self.eos if accepting else ():
            if t in self.special and hit[t // 8] >> (t % 8) & 1:
                kept[t // 8] |= 1 << (t % 8)
        if not kept.any():
            names = ", ".join(self.special[t] for t in sorted(self.special)
                              if t < 8 * len(bits) and hit[t // 8] >> (t % 8) & 1)
            raise InvalidParameter(f"structured decoding failed: the constraint goes on only with the text of a special "
                                   f"token ({names}), which no output holds", param="constraint")
        return kept

    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        rows = generated_lists(histories)
        masks = self._bitmasks(rows, self._settle())
        logits = logits.to(torch.float32).contiguous()
        out = torch.empty_like(logits)
        for row, tokens in enumerate(rows):
            bits = masks[tuple(tokens)]
            if bits is not None:
                mask_logits(out[row], bits, source=logits[row])
            else:  # a path the grammar refuses (a rejected draft): its parent's mask gave it no
                # probability; its row keeps the model's logits, finite, since a verification
                # normalises every row (a row of -inf alone would be NaN there, and refused)
                out[row] = logits[row]
        return out

    def greedy_choice(self, logits: torch.Tensor, history: Sequence[torch.Tensor]) -> int | None:
        (row,) = generated_lists(history)
        bits = self._bitmasks([row], self._settle())[tuple(row)]
        return None if bits is None else masked_argmax(logits.to(torch.float32).contiguous(), bits)

    def surely_allows(self, token: int, history: Sequence[torch.Tensor]) -> bool:
        """Whether the mask for the row would allow ``token``, answered without the mask (a choice
        made before masking, :meth:`..sampler.Sampler.pick_at`, stands where this says so): False
        where only the mask can tell, and where a mask computed ahead waits for the row.
        llguidance's mask is what its parser takes (``validate_tokens``), with the end token where the
        grammar accepts, unless the grammar forces bytes next: then the mask holds only the canonical
        tokens of that text (``"name"``, not ``"n"``), while the parser takes any spelling. A token
        past the grammar's vocabulary is never asked (the matcher would go into its error state)."""
        (row,) = generated_lists(history)
        if tuple(row) in self._settle() or (matcher := self._follow(row)) is None:
            return False
        if token < 0 or (self.vocab is not None and token >= self.vocab) or token in self.special:
            return False
        forced = matcher.compute_ff_bytes()
        self._check(matcher)
        return not forced and matcher.validate_tokens([token]) == 1

    def describe(self) -> dict[str, Any]:
        return {"constraint": self.constraint.kind}

    def forced(self, generated: list[int]) -> list[int]:
        """llguidance's fast-forward tokens after ``generated``: the canonical tokens of the text the
        grammar fixes next (a JSON key, a literal). The mask may still allow another spelling of that
        text, so they are a draft to verify, not tokens to commit unseen."""
        self._settle()
        if (matcher := self._follow(list(generated))) is None:
            return []
        tokens = list(matcher.compute_ff_tokens())
        self._check(matcher)
        return tokens

    def allowed_prefix(self, generated: list[int], continuation: list[int]) -> int:
        """llguidance's count of the tokens of ``continuation`` the grammar takes after ``generated``
        (``validate_tokens``: its parser, without a mask). It has been seen to allow a token the mask
        refuses (a space, an "e" after a number, in a few states of a JSON grammar), never the other
        way round but for the end token, which the mask allows where the grammar accepts and it does
        not: a caller uses it to drop drafts, which either way only ever costs a verification row."""
        self._settle()
        if (matcher := self._follow(list(generated))) is None:
            return 0
        return matcher.validate_tokens(self._known(list(continuation)))

    def broken_by(self, generated: list[int]) -> str | None:
        self._settle()
        matcher, taken = self.paths.at(list(generated))
        self._check(matcher)
        if taken == len(generated):
            if self.constraint.kind == "json_schema" and matcher.is_accepting():
                self._check_schema(self._text_of(list(generated)))
            return None
        if self._dead_end(matcher):  # not a fault of decoding: no token writes what the grammar needs next
            raise InvalidParameter(f"structured decoding failed: after {self._text_of(list(generated[:taken]))!r} the "
                                   f"{self.constraint.kind.replace('_', ' ')} constraint needs text that no token of this "
                                   "model's vocabulary writes", param="constraint")
        return f"the output breaks its {self.constraint.kind.replace('_', ' ')} constraint"

    def _check_schema(self, text: str) -> None:
        """A finished answer to a json_schema constraint, checked against the schema itself: llguidance's
        grammar lets through some values a schema refuses (:func:`schema_refusal`), and such an answer
        is an error, never a result."""
        refused = schema_refusal(self.constraint.schema(), text)
        if refused is not None:
            raise InvalidParameter(f"structured decoding failed: the answer {text!r:.200} breaks the JSON schema, which "
                                   f"llguidance's grammar for it let through: {refused:.300}", param="constraint")

    def _dead_end(self, matcher) -> bool:
        """Whether no token goes on from ``matcher``'s state: its mask allows none, or none of the few
        it allows is one its parser takes (a tokenizer that cannot spell a character the grammar
        fixes: llguidance spells forced text with the tokenizer's own encoding, which may replace it)."""
        allowed = np.flatnonzero(np.unpackbits(self._bitmask(matcher), bitorder="little"))
        if len(allowed) > DEAD_END_CHECKS:
            return False
        return not any(matcher.validate_tokens(self._known([int(t)])) == 1 for t in allowed)

    def _text_of(self, tokens: list[int]) -> str:
        """What ``tokens`` write, as the grammar's tokenizer spells them (for messages)."""
        if self.lltokenizer is None:
            return f"tokens {tokens}"
        return self.lltokenizer.decode_bytes(self._known(tokens)).decode("utf-8", "replace")


def checked_grammar(constraint: Constraint | dict, lltokenizer=None) -> tuple[Constraint, str]:
    """``constraint`` and its llguidance grammar, checked (against ``lltokenizer`` when given, which
    also catches what a vocabulary cannot spell); an invalid schema, pattern or grammar is one
    InvalidParameter line."""
    from llguidance import LLMatcher

    constraint = Constraint.coerce(constraint)
    grammar = constraint.grammar()
    error = LLMatcher.validate_grammar(grammar, lltokenizer).strip()
    if error:
        raise InvalidParameter(f"invalid {constraint.kind.replace('_', ' ')} constraint: {grammar_error_line(error)}")
    return constraint, grammar


def constraint_processor(constraint: Constraint | dict, tokenizer) -> ConstrainedTokens:
    """Compile ``constraint`` for ``tokenizer`` (a :class:`..models.tokenizer.Tokenizer`, which keeps
    what it compiled); an invalid schema, pattern or grammar is one InvalidParameter line."""
    constraint = Constraint.coerce(constraint)
    grammar = constraint.grammar()
    try:
        matcher = tokenizer.grammar_matcher(grammar)
    except ValueError as error:
        raise InvalidParameter(f"invalid {constraint.kind.replace('_', ' ')} constraint: {error}") from None
    lltokenizer = tokenizer.grammar_tokenizer()
    if constraint.kind == "choice":  # each choice must be written by some tokens, or decoding reaches a dead end in it
        for choice in constraint.value:
            if lltokenizer.decode_bytes(lltokenizer.greedy_tokenize(choice)) != choice.encode():
                raise InvalidParameter(f"choice {choice!r} cannot be written with this model's tokens (its vocabulary "
                                       "has no token for part of it)", param="constraint")
    return ConstrainedTokens(matcher, constraint, lltokenizer.vocab_size, tokenizer.special_tokens(), tokenizer.eos_token_ids,
                             lltokenizer)
