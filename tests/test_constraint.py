"""Structured decoding (samplers/constraint.py): outputs match their constraint with every kind
of method, speculative decoding under a constraint is token-identical to constrained plain
decoding, and a bad schema, pattern or grammar is one clear line."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tests.conftest import record_verified_tree_sizes, required_options
from decodekit.engine import Engine, available_methods  # noqa: E402
from decodekit.errors import InvalidParameter  # noqa: E402
from decodekit.models import CharTokenizer, LoadedModel  # noqa: E402
from decodekit.models.tiny import tiny_llama  # noqa: E402
from decodekit.samplers.base import Histories  # noqa: E402
from decodekit.samplers.constraint import Constraint, checked_grammar, constraint_processor  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}
COMPACT = {"x-guidance": {"whitespace_flexible": False}, **SCHEMA}  # a random model would pad with spaces forever
REGEX = r"[a-c]{2,5}![0-9]{2}"
CHOICES = ["red", "green", "blue"]
CASES = [({"json_schema": COMPACT}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
         ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(f"{t!r} does not match {REGEX}")),
         ({"choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(f"{t!r} is not a choice"))]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))


@pytest.mark.parametrize("constraint, valid", CASES, ids=["json_schema", "regex", "choice"])
def test_greedy_and_seeded_sampling_give_only_valid_outputs(engine, constraint, valid):
    outputs = set()
    for prompt in ("hello", "abcabc", "Q: "):
        g = engine.generate(prompt, max_new_tokens=40, chat=False, constraint=constraint)
        assert g.finish_reason == "eos"
        valid(g.text)
        for seed in range(6):
            s = engine.generate(prompt, method="sample", temperature=1.0, seed=seed, max_new_tokens=40, chat=False,
                                constraint=constraint)
            valid(s.text)
            outputs.add(s.text)
    assert len(outputs) > 1  # sampling still samples among the allowed outputs


def speculative_methods() -> list[str]:
    return sorted(n for n, s in available_methods().items() if s.family == "speculative")


@pytest.mark.parametrize("ahead", [True, False], ids=["masks-ahead", "masks-inline"])
@pytest.mark.parametrize("method", speculative_methods())
def test_speculation_under_a_constraint_is_constrained_plain_decoding(engine, method, ahead, monkeypatch):
    """Each verified node is masked for its own path, so drafts the grammar refuses are never
    accepted and the tokens are constrained greedy's (and constrained keyed sampling's); with the
    masks computed ahead in the background (a core to spare) and without."""
    from decodekit.samplers.constraint import ConstrainedTokens

    monkeypatch.setattr(ConstrainedTokens, "looks_ahead", ahead)
    for constraint, valid in CASES:
        for prompt in ("hello hello hello", "abcabcabc"):
            want = engine.generate(prompt, max_new_tokens=40, chat=False, constraint=constraint).tokens
            required = required_options(method, engine.model.backend)
            got = engine.generate(prompt, method=method, budget=4, max_new_tokens=40, chat=False, constraint=constraint,
                                  **required)
            assert got.tokens == want, (method, constraint)
            sampled = dict(temperature=0.9, seed=3, max_new_tokens=40, chat=False, constraint=constraint)
            want = engine.generate(prompt, method="sample", **sampled).tokens
            assert engine.generate(prompt, method=method, budget=4, **sampled, **required).tokens == want, (method, constraint)


FIXED = r"ab[0-9]cdefghij[0-9]"  # "ab", then eight characters the grammar fixes after the first digit


@pytest.mark.parametrize("method", ["pld", "suffix", "recycling"])
def test_text_the_grammar_fixes_is_a_free_draft_verified_in_one_pass(engine, method):
    """The forced characters are drafted whatever the controller grants (budget 0 included), all
    accepted in one verification, and the output is constrained plain decoding's."""
    for sampled in ({}, {"method": "sample", "temperature": 0.9, "seed": 5}):
        plain = engine.generate("xyz", max_new_tokens=20, chat=False, constraint={"regex": FIXED}, **sampled)
        assert re.fullmatch(FIXED, plain.text)
        options = {k: v for k, v in sampled.items() if k != "method"}
        for budget in (0, 4):
            got = engine.generate("xyz", method=method, budget=budget, max_new_tokens=20, chat=False,
                                  constraint={"regex": FIXED}, **options)
            assert got.tokens == plain.tokens
            forced = len("b") + len("cdefghij")  # "a" comes from the prompt's pass, then "b"; after the digit, the rest
            assert got.stats.extra["accepted_by_source"]["forced"] == forced
            assert got.stats.forward_passes == plain.stats.forward_passes - forced  # each forced token saves a pass


def test_wrong_forced_text_is_only_a_refused_draft(engine, monkeypatch):
    """Forced tokens are verified, never committed unseen: offered text the grammar refuses, or the
    model does not choose, leaves the output constrained plain decoding's, and once refused more
    than half the time it is no longer offered."""
    from decodekit.samplers import constraint as constraint_module

    spell = CharTokenizer(96).encode
    monkeypatch.setattr(constraint_module.ConstrainedTokens, "forced", lambda self, generated: spell("zzzz"))
    for sampled in ({}, {"temperature": 0.9, "seed": 5}):
        for constraint, _ in CASES:
            plain = engine.generate("hello", method="sample" if sampled else "greedy", max_new_tokens=30, chat=False,
                                    constraint=constraint, **sampled)
            got = engine.generate("hello", method="pld", max_new_tokens=30, chat=False, constraint=constraint, **sampled)
            assert got.tokens == plain.tokens
            assert got.stats.extra["forced_drafted"] <= 16 + 4  # offered until 16 were refused, then no more


def test_forced_text_is_offered_while_the_model_accepts_half_of_it(engine, monkeypatch):
    """Forcing stops only once the model has refused more than half of the forced tokens: forced
    chains of two whose first token is the model's own and whose second is not (half accepted)
    are offered at every step, past the trial's 16 tokens."""
    from decodekit.samplers import constraint as constraint_module
    from decodekit.speculative.loop import FORCED_TRIAL

    constraint = {"regex": "[a-z]{40}"}
    want = engine.generate("hello", max_new_tokens=40, chat=False, constraint=constraint).tokens
    spell = CharTokenizer(96).encode

    def forced(self, generated):  # the model's next token, then one it does not choose
        i = len(generated)
        return [want[i], next(t for t in spell("zy") if t != want[i + 1])] if i + 1 < len(want) else []

    monkeypatch.setattr(constraint_module.ConstrainedTokens, "forced", forced)
    got = engine.generate("hello", method="pld", max_new_tokens=40, chat=False, constraint=constraint)
    assert got.tokens == want
    extra = got.stats.extra
    # every forced chain: its first token accepted, its second refused (the bonus is the model's own)
    assert extra["forced_drafted"] == 2 * extra["accepted_by_source"]["forced"] > FORCED_TRIAL + 2


def test_a_refused_forced_token_is_refused_though_the_step_yields_a_bonus(engine, monkeypatch):
    """The bonus token a verification adds is no accepted forced token: a one-token forced text the
    model never takes is refused every time, and after the trial's 16 it is offered no more."""
    from decodekit.samplers import constraint as constraint_module
    from decodekit.speculative.loop import FORCED_TRIAL

    constraint = {"regex": "[a-y]{40}"}  # "z" is never allowed: the forced "z" is always refused
    plain = engine.generate("hello", max_new_tokens=40, chat=False, constraint=constraint)
    spell = CharTokenizer(96).encode
    monkeypatch.setattr(constraint_module.ConstrainedTokens, "forced", lambda self, generated: spell("z"))
    got = engine.generate("hello", method="pld", max_new_tokens=40, chat=False, constraint=constraint)
    assert got.tokens == plain.tokens
    assert got.stats.extra["forced_drafted"] == FORCED_TRIAL
    assert "forced" not in got.stats.extra.get("accepted_by_source", {})


def test_forced_text_at_the_end_of_the_context(engine):
    """A prompt that leaves room for one new token: no forced chain is verified past the context."""
    prompt = "x" * (engine.model.backend.info.max_length - 1)
    plain = engine.generate(prompt, max_new_tokens=1, chat=False, constraint={"regex": FIXED})
    assert engine.generate(prompt, method="pld", max_new_tokens=1, chat=False, constraint={"regex": FIXED}).tokens == plain.tokens


def test_forced_tokens_follow_the_rows_own_text():
    processor = constraint_processor({"regex": FIXED}, CharTokenizer(96))
    spell = CharTokenizer(96).encode
    assert processor.forced([]) == spell("ab")
    assert processor.forced(spell("ab")) == []  # a digit: ten choices
    assert processor.forced(spell("ab7")) == spell("cdefghij")
    assert processor.forced(spell("ab7cde")) == spell("fghij")
    assert processor.forced(spell("ax")) == []  # a path the grammar refuses forces nothing
    assert processor.forced(spell("ab3cd")) == spell("efghij")  # and the matcher is back on the row's text after it


def test_search_methods_keep_each_candidate_valid(engine):
    for method, options in (("best-of-n", {"n": 4, "temperature": 1.0, "seed": 0}),
                            ("self-consistency", {"n": 4, "temperature": 1.0, "seed": 1})):
        g = engine.generate("hello", method=method, max_new_tokens=40, chat=False, constraint={"regex": REGEX}, **options)
        assert re.fullmatch(REGEX, g.text), (method, g.text)


def test_the_mask_follows_each_rows_own_path():
    """One processor, rows at different points of the grammar (as in a verification tree): each
    row gets the mask of its own generated tokens, whatever order the rows come in."""
    tok = CharTokenizer(96)
    proc = constraint_processor({"regex": "ab|ac|bd"}, tok)
    prompt = tok.encode("zz")
    rows = [prompt, prompt + tok.encode("a"), prompt + tok.encode("b"), prompt + tok.encode("ab"), prompt + tok.encode("a")]
    out = proc(torch.zeros(len(rows), 96), Histories(rows, len(prompt)))
    allowed = [{tok.decode([i]) if i else "<eos>" for i in range(96) if out[r, i] > float("-inf")} for r in range(len(rows))]
    assert allowed == [{"a", "b"}, {"b", "c"}, {"d"}, {"<eos>"}, {"b", "c"}]


def test_a_row_reached_after_another_paths_mask_gets_its_own_mask():
    """llguidance keeps its last mask by parser row and lexer state, and a rollback leaves it there:
    a row reached after a sibling's mask on a path of as many lexemes would get the sibling's mask.
    Each row's mask here is the one a fresh processor gives it alone, in any order of the rows."""
    import itertools

    tok = CharTokenizer(96)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    texts = ['{ "name": "x" ', '{"name": "x", ', '{"name": "x" ', '{ "name": "xy"', '{"name": "x", "age": 1']
    rows = [tok.encode(t) for t in texts]

    def masks(proc, order):
        out = proc(torch.zeros(len(order), 96), Histories([rows[i] for i in order], 0))
        return {i: out[k] > float("-inf") for k, i in enumerate(order)}

    alone = {i: masks(constraint_processor({"json_schema": schema}, tok), [i])[i] for i in range(len(rows))}
    assert not torch.equal(alone[0], alone[1])  # the first two rows allow different tokens next
    for order in itertools.permutations(range(len(rows)), 3):
        proc = constraint_processor({"json_schema": schema}, tok)
        for step in (order, order[::-1]):  # one call, and again in the other order
            got = masks(proc, list(step))
            assert all(torch.equal(got[i], alone[i]) for i in step), (order, step)


def test_every_candidate_of_a_search_under_a_json_schema_keeps_to_it():
    """A search's rows share one processor and branch from the first token: each candidate, finished
    or cut off, is a text the schema allows (a fresh processor follows every one of its tokens)."""
    tok = CharTokenizer(96)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    engine = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64), tok, "tiny"))
    for seed in range(6):
        g = engine.generate([{"role": "user", "content": "hello world"}], method="best-of-n", n=8, max_new_tokens=40,
                            temperature=1.0, seed=seed, constraint={"json_schema": schema})
        for candidate in g.extra["candidates"]:
            assert constraint_processor({"json_schema": schema}, tok).broken_by(tok.encode(candidate["text"])) is None, \
                (seed, candidate["text"])


@pytest.mark.parametrize("verifier", ["greedy", "keyed", "rejection"])
def test_a_verification_masks_only_the_rows_on_its_path(monkeypatch, verifier):
    """Under a grammar, each verifier masks a row only when its walk from the root reaches it: a tree
    whose drafts are rejected after the first node costs two masks, not one a row, and gives the
    path and bonus of the rows masked all at once."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.samplers import Sampler
    from decodekit.samplers.constraint import ConstrainedTokens
    from decodekit.speculative.tree import DraftTree
    from decodekit.speculative import verify

    tok = CharTokenizer(96)
    a, b = tok.encode("ab")
    tree = DraftTree([a, a, a, b, b], [-1, 0, 1, -1, 3])  # root -> "aaa" and root -> "bb", every row allowed
    logits = torch.full((len(tree) + 1, 96), -5.0)
    logits[0, a] = logits[1, b] = 50.0  # the model wants "a", then "b": the first node accepted, then the bonus
    masks: list[int] = []
    original = ConstrainedTokens._bitmask
    monkeypatch.setattr(ConstrainedTokens, "_bitmask", lambda self, matcher: masks.append(1) or original(self, matcher))

    def verify_with(row_histories):
        monkeypatch.setattr(verify, "row_histories", row_histories)
        sampler = Sampler([constraint_processor({"regex": "[ab]+"}, tok)], greedy=verifier == "greedy", seed=0)
        state = DecodeState(tiny_llama(seed=0), sampler, tok.encode("zz"), GenerationStats())
        masks.clear()
        choice = {"greedy": verify.GreedyVerifier, "keyed": verify.KeyedVerifier, "rejection": verify.SamplingVerifier}
        return choice[verifier]().verify(state, tree, logits), len(masks)

    (lazy, lazy_masks), (every, every_masks) = verify_with(verify.row_histories), verify_with(lambda state, tree: None)
    assert (lazy.path, lazy.bonus) == (every.path, every.bonus) == ([0], b)
    # the root's and "a"'s rows, against every row; the verifiers that choose each row's token as plain
    # decoding does (greedy, keyed) take the model's own choice where the grammar allows it, with no mask
    assert lazy_masks == (2 if verifier == "rejection" else 0) and every_masks == len(tree) + 1


def test_drafts_the_grammar_refuses_are_dropped_before_verification():
    """A tree is cut at each path's first token the grammar refuses, with what hangs below it; only
    for the verifiers that follow plain decoding's choices, and only for drafters whose trees may
    be trimmed (rejection sampling's draws depend on every sibling)."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.samplers import Sampler
    from decodekit.speculative.controller import Controller
    from decodekit.speculative.drafters.ngram import PromptLookup
    from decodekit.speculative.loop import SpeculativeMethod
    from decodekit.speculative.tree import DraftTree
    from decodekit.speculative.verify import GreedyVerifier, KeyedVerifier, SamplingVerifier

    tok = CharTokenizer(96)
    a, b, c, x = tok.encode("abcx")
    # after "ab" the regex takes c or d, then the end: root -> c -> {x, d-less c}, root -> x -> a, root -> a
    tree = DraftTree([c, x, c, x, a, a], [-1, 0, 0, -1, 3, -1])
    processor = constraint_processor({"regex": "ab[cd]"}, tok)
    state = DecodeState(tiny_llama(seed=0), Sampler([processor], greedy=True), tok.encode("zz") + [a, b], GenerationStats())
    state.prompt_len = 2  # "ab" generated

    def kept(verifier, trimmable=True):
        method = SpeculativeMethod(PromptLookup(), Controller(8), verifier)
        method.verifier, method.refused = verifier, 0
        method.drafter.trimmable = trimmable
        out = method._allowed(state, tree)
        return [(out.tokens[i], -1 if p < 0 else out.tokens[p]) for i, p in enumerate(out.parents)], method.refused

    assert kept(GreedyVerifier()) == ([(c, -1)], 5)  # "abc" only: "abcx", "abcc", "abx...", "aba" refused
    assert kept(KeyedVerifier())[0] == [(c, -1)]
    assert kept(SamplingVerifier())[0] == kept(GreedyVerifier(), trimmable=False)[0] == list(zip(tree.tokens, [-1, c, c, -1, x, -1]))


def test_ids_past_the_grammars_vocabulary_are_refused_without_breaking_the_matcher():
    """A draft of a padded vocabulary's id (past the tokenizer's): llguidance's matcher would go into
    its error state on it, even to validate it; it is refused, and the rows after it are masked as before."""
    tok = CharTokenizer(96)
    processor = constraint_processor({"regex": "[ab]+"}, tok)
    a, b = tok.encode("ab")
    assert processor.allowed_prefix([a], [b, 96, a]) == 1 and processor.allowed_prefix([a], [-1]) == 0
    prompt = tok.encode("zz")
    rows = [prompt + [a, 500], prompt + [a, b]]
    out = processor(torch.zeros(2, 96), Histories(rows, len(prompt)))
    assert not any(m.is_error() for m in processor.paths.matchers())
    assert {i for i in range(96) if out[1, i] > float("-inf")} == {0, a, b}  # the end, "a" and "b" after "ab"


@pytest.mark.parametrize("method", ["pld", "suffix"])
def test_refused_drafts_leave_the_output_constrained_plain_decoding(engine, method):
    """Drafts from a prompt the grammar cannot spell are dropped (counted), and the tokens are still
    constrained greedy's and constrained keyed sampling's."""
    prompt = "aaz abz acz baz bbz bcz caz cbz ccz " * 2  # after any two letters: a "z" the grammar refuses
    for sampled in ({}, {"temperature": 0.9, "seed": 4}):
        plain = engine.generate(prompt, method="sample" if sampled else "greedy", max_new_tokens=30, chat=False,
                                constraint={"regex": REGEX}, **sampled)
        got = engine.generate(prompt, method=method, budget=4, max_new_tokens=30, chat=False, constraint={"regex": REGEX},
                              **sampled)
        assert got.tokens == plain.tokens
        assert got.stats.extra.get("refused_drafts", 0) > 0, got.stats.extra


def test_a_grammar_is_compiled_once_and_each_processor_follows_its_own_copy(monkeypatch):
    """The tokenizer keeps compiled grammars: a second processor for the same constraint is not
    compiled again, and the two do not share a matcher's state; a bad grammar is never kept."""
    import llguidance

    from decodekit.models import tokenizer as tokenizer_module

    compiled: list[str] = []
    original = llguidance.LLMatcher

    class Counting:
        validate_grammar = staticmethod(original.validate_grammar)
        grammar_from_regex = staticmethod(original.grammar_from_regex)

        def __new__(cls, lltokenizer, grammar, **kwargs):
            compiled.append(grammar)
            return original(lltokenizer, grammar, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting)
    monkeypatch.setattr(tokenizer_module, "GRAMMARS_KEPT", 2)
    tok = CharTokenizer(96)
    first, second = (constraint_processor({"regex": "ab|ac|bd"}, tok) for _ in range(2))
    assert len(compiled) == 1 and first.paths.anchor is not second.paths.anchor
    prompt = tok.encode("zz")

    def allowed(proc, text: str) -> set[str]:
        out = proc(torch.zeros(1, 96), Histories([prompt + tok.encode(text)], len(prompt)))
        return {tok.decode([i]) if i else "<eos>" for i in range(96) if out[0, i] > float("-inf")}

    assert allowed(first, "a") == {"b", "c"} and allowed(second, "b") == {"d"} and allowed(first, "a") == {"b", "c"}
    for _ in range(2):
        with pytest.raises(InvalidParameter, match="^invalid regex constraint"):
            constraint_processor({"regex": "[0-9"}, tok)
    constraint_processor({"regex": "x"}, tok), constraint_processor({"regex": "y"}, tok)  # "ab|ac|bd" is dropped
    constraint_processor({"regex": "ab|ac|bd"}, tok)
    assert compiled.count(Constraint.coerce({"regex": "ab|ac|bd"}).grammar()) == 2 and len(compiled) == 4
    # the least recently used goes: "y", used again, outlives "ab|ac|bd", compiled after it
    constraint_processor({"regex": "y"}, tok), constraint_processor({"regex": "z"}, tok)
    constraint_processor({"regex": "y"}, tok)
    assert len(compiled) == 5


def test_a_greedy_step_under_a_grammar_is_the_argmax_of_the_masked_row():
    """The sampler's greedy step asks the grammar for its best allowed token without masking the
    row (``greedy_choice``): the argmax of the processor's output for each row's own path, with
    random logits full of ties, the prepared masks of another path pending, and None for a row
    the grammar refuses (then the sampler masks the row as any processor's)."""
    from decodekit.samplers import Sampler

    tok = CharTokenizer(96)
    prompt = tok.encode("zz")
    proc = constraint_processor({"regex": "[a-c]{2,5}![0-9]{2}"}, tok)
    generator = torch.Generator().manual_seed(3)
    for text in ("", "a", "ab", "abcab", "abcab!", "ab!1", "ab!12", "b", "a", ""):
        row = prompt + tok.encode(text)
        history = Histories([row], len(prompt))
        logits = torch.randint(-2, 2, (96,), generator=generator).float()
        proc.prepare([tok.encode("ca")])  # another row's mask pending: not this row's
        want = int(proc(logits[None], history)[0].argmax())
        assert proc.greedy_choice(logits, history) == want, text
        assert Sampler([proc], greedy=True).pick_at(logits, len(row), history) == want
    assert proc.greedy_choice(torch.zeros(96), Histories([prompt + tok.encode("x")], len(prompt))) is None


class PairTokenizer(CharTokenizer):
    """CharTokenizer with one more token, "ab" (id 96): the text "ab" has two spellings."""

    PAIR = 96

    def __init__(self):
        super().__init__(97)

    def decode(self, ids):
        return "".join("ab" if i == self.PAIR else CharTokenizer.decode(self, [i]) for i in ids)

    def _make_grammar_tokenizer(self):
        from llguidance import LLTokenizer, TokenizerWrapper

        char = self

        class Vocabulary:
            eos_token_id, bos_token_id, special_token_ids = 0, None, [0]
            tokens = [b"<eos>"] + [chr(i + CharTokenizer.OFFSET).encode() for i in range(1, 96)] + [b"ab"]

            def __call__(self, text: bytes) -> list[int]:
                return char.encode(text.decode("utf-8", "replace"))

        return LLTokenizer(TokenizerWrapper(Vocabulary()))


@pytest.mark.parametrize("regex, text, masked", [
    ("x(ab|cd)", "x", False),  # nothing forced and "ab" allowed: the model's choice, no mask
    ("x(ab|cd)", "", True),  # "x" forced; the parser refuses "ab": the mask's choice
    ("[0-9]ab", "1", True),  # "ab" forced: the parser takes the token "ab", the mask only "a"
    ("[0-9]ab", "", True),  # a digit next: refused
])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_the_models_choice_is_taken_unmasked_only_where_the_mask_would_give_it(monkeypatch, regex, text, masked, greedy):
    """A step under a grammar chooses before any mask (the argmax, or the keyed race): the choice
    stands where the grammar allows it, which must be exactly where the mask would (llguidance's mask
    holds only the canonical spelling of text the grammar forces, its parser any spelling); otherwise
    the choice under the mask. Pointwise processors after the mask (here a temperature) keep it so."""
    from decodekit.samplers import Sampler
    from decodekit.samplers.constraint import ConstrainedTokens
    from decodekit.samplers.truncation import Temperature

    tok = PairTokenizer()
    masks: list[int] = []
    original = ConstrainedTokens._bitmask
    monkeypatch.setattr(ConstrainedTokens, "_bitmask", lambda self, matcher: masks.append(1) or original(self, matcher))
    prompt = tok.encode("zz")
    history = Histories([prompt + tok.encode(text)], len(prompt))
    logits = torch.zeros(100)  # a model vocabulary padded past the grammar's
    logits[tok.PAIR] = 30.0  # the model wants "ab": even the keyed race picks it
    wants = []
    for padded in (False, True):  # then, above it, an id the grammar does not have
        logits[98] = 60.0 if padded else 0.0
        sampler = Sampler([constraint_processor({"regex": regex}, tok), Temperature(0.5)], greedy=greedy, seed=1)
        x = sampler.process(logits[None], history)[0]
        wants.append(int(x.argmax()) if greedy else sampler.sample_at(torch.softmax(x, dim=-1), 7))
        sampler = Sampler([constraint_processor({"regex": regex}, tok), Temperature(0.5)], greedy=greedy, seed=1)
        masks.clear()
        assert sampler.pick_at(logits, 7, history) == wants[-1]
        assert masks == ([1] if masked or padded else [])
        assert not any(m.is_error() for m in sampler.processors[0].paths.matchers())
    assert (wants[0] == tok.PAIR) == (not masked) and wants[1] == wants[0]


def test_a_choice_before_the_mask_only_where_every_later_processor_is_pointwise():
    """Seeded steps under a grammar with random logits: the sampler's token is the one of the masked
    row, with pointwise processors after the mask (penalties, temperature) and with ones that look at
    the whole row (top-k), greedy and sampled, at many positions."""
    from decodekit.samplers import Sampler
    from decodekit.samplers.penalties import FrequencyPenalty, RepetitionPenalty
    from decodekit.samplers.truncation import Temperature, TopK

    tok = PairTokenizer()
    prompt = tok.encode("zz")
    generator = torch.Generator().manual_seed(5)
    chains = [[], [Temperature(0.7)], [RepetitionPenalty(1.3), FrequencyPenalty(0.5), Temperature(1.5)], [TopK(2)],
              [Temperature(2.0), TopK(3)]]
    for rest in chains:
        for greedy in (True, False):
            for position, text in enumerate(("", "a", "ab", "b", "ba", "abab!", "ab!1", "c", "cc", "ccab")):
                history = Histories([prompt + tok.encode(text)], len(prompt))
                logits = torch.randn(97, generator=generator) * 3
                sampler = Sampler([constraint_processor({"regex": "[a-c]{2,5}![0-9]{2}"}, tok), *rest], greedy=greedy, seed=3)
                x = sampler.process(logits[None], history)[0]
                want = int(x.argmax()) if greedy else sampler.sample_at(torch.softmax(x, dim=-1), position)
                assert sampler.pick_at(logits, position, history) == want, (rest, greedy, text)
    # where a processor looks at the whole row, the mask must come first: after "d" is refused, top-2
    # keeps "a" and "b", not "a" and "d" (then "a" would win every draw "d" does not)
    a, b, d = tok.encode("abd")
    logits = torch.full((97,), -10.0)
    logits[a], logits[d], logits[b] = 5.0, 5.0, 4.9
    history = Histories([prompt], len(prompt))
    drawn, wanted = [], []
    for seed in range(40):
        sampler = Sampler([constraint_processor({"regex": "[ab]"}, tok), TopK(2)], seed=seed)
        wanted.append(sampler.sample_at(torch.softmax(sampler.process(logits[None], history)[0], dim=-1), 0))
        drawn.append(sampler.pick_at(logits, 0, history))
    assert drawn == wanted and set(drawn) == {a, b}


def record_mask_threads(monkeypatch, gate=None) -> list[str]:
    """The thread of each mask the processors compute from now on (each waits for ``gate`` first)."""
    import threading

    from decodekit.samplers.constraint import ConstrainedTokens

    threads: list[str] = []
    original = ConstrainedTokens._bitmask

    def recorded(self, matcher):
        threads.append(threading.current_thread().name)
        if gate is not None:
            gate.wait(30)
        return original(self, matcher)

    monkeypatch.setattr(ConstrainedTokens, "_bitmask", recorded)
    return threads


def test_masks_computed_ahead_are_each_rows_own_masks(monkeypatch):
    """Masks prepared in the background (while a forward pass would run) are the masks of the rows
    given, and a call takes them for those rows, in any order, beside rows computed on the spot."""
    tok = CharTokenizer(96)
    prompt = tok.encode("zz")
    rows = [prompt + tok.encode(t) for t in ("", "a", "b", "ab", "x", "ac")]  # "x": refused by the grammar
    fresh = constraint_processor({"regex": "ab|ac|bd"}, tok)
    want = fresh(torch.zeros(len(rows), 96), Histories(rows, len(prompt)))
    proc = constraint_processor({"regex": "ab|ac|bd"}, tok)
    threads = record_mask_threads(monkeypatch)
    proc.prepare([r[len(prompt):] for r in reversed(rows[1:])])  # not the root; another order
    got = proc(torch.zeros(len(rows), 96), Histories(rows, len(prompt)))
    assert torch.equal(got, want)
    assert threads.count("MainThread") == 1  # the root's, not prepared
    background = [t for t in threads if t != "MainThread"]
    assert len(background) == 4 and all(t.startswith("decodekit-mask") for t in background)  # "x" needs none
    # the prepared masks serve every call until the next prepare (a verification asks row by row)
    assert proc(torch.zeros(len(rows), 96), Histories(rows, len(prompt))).equal(want)
    assert threads[5:] == ["MainThread"]  # the root's again
    proc.prepare([rows[0][len(prompt):]])
    assert proc(torch.zeros(len(rows), 96), Histories(rows, len(prompt))).equal(want)
    assert threads[6].startswith("decodekit-mask") and threads[7:] == ["MainThread"] * 4  # the root's ahead


@pytest.mark.parametrize("method", ["greedy", "sample", "pld"])
def test_decoding_with_masks_computed_ahead_is_decoding_without(engine, method, monkeypatch):
    """The decode loops hand each pass's rows to the processor before the pass (all but the masks
    right after prefill are computed ahead), and the tokens are those of masks computed on the spot."""
    import threading

    from decodekit.samplers.constraint import ConstrainedTokens

    options = dict(max_new_tokens=40, chat=False, method=method) | ({"temperature": 0.9, "seed": 2} if method != "greedy" else {})
    where: list[str] = []
    bitmask = ConstrainedTokens._bitmask
    monkeypatch.setattr(ConstrainedTokens, "_bitmask",
                        lambda self, matcher: where.append(threading.current_thread().name) or bitmask(self, matcher))
    monkeypatch.setattr(ConstrainedTokens, "looks_ahead", True)  # as with a core to spare
    for constraint, valid in CASES:
        ahead = [engine.generate(prompt, constraint=constraint, **options).tokens for prompt in ("hello", "abcabc")]
        assert where.count("MainThread") <= 2 and len(where) > 8, where  # one after each prefill
        with monkeypatch.context() as m:
            m.setattr(ConstrainedTokens, "looks_ahead", False)
            assert [engine.generate(prompt, constraint=constraint, **options).tokens for prompt in ("hello", "abcabc")] == ahead
        where.clear()


@pytest.mark.parametrize("method", ["greedy", "sample"])
def test_a_row_whose_mask_was_computed_ahead_moves_its_own_matcher_on(engine, method, monkeypatch):
    """A row served a mask computed ahead keeps its path for the next pass's rows, which grow from it:
    the matcher moves on from there, and only the prefill's row branches from the anchor (a copy of
    the anchor brought along the whole output at every pass would cost a parse of it each token)."""
    from decodekit.samplers import constraint as constraint_module
    from decodekit.samplers.constraint import ConstrainedTokens

    branched: list[int] = []
    move = constraint_module.MatcherPaths._move_anchor
    monkeypatch.setattr(constraint_module.MatcherPaths, "_move_anchor",
                        lambda self, tokens: branched.append(len(tokens)) or move(self, tokens))
    monkeypatch.setattr(ConstrainedTokens, "looks_ahead", True)  # as with a core to spare
    schema = {"type": "array", "items": {"type": "string"}}
    options = {"temperature": 0.9, "seed": 2} if method == "sample" else {}
    got = engine.generate("abc abc abc", method=method, max_new_tokens=40, chat=False, constraint={"json_schema": schema},
                          **options)
    assert len(got.tokens) == 40 and branched == [0]


def test_a_call_about_more_rows_than_are_kept_keeps_the_last_rows_paths():
    """At most KEPT matchers are kept, each holding parser state for its whole row: a call asking
    about more rows (a wide batch or tree) keeps the paths of the rows it asked about last."""
    from itertools import product

    tok = CharTokenizer(96)
    proc = constraint_processor({"regex": "[ab]+"}, tok)
    kept = proc.paths.KEPT
    prompt = tok.encode("zz")
    rows = [prompt + tok.encode("".join(letters)) for letters in product("ab", repeat=7)][: kept + 6]
    out = proc(torch.zeros(len(rows), 96), Histories(rows, len(prompt)))
    assert bool((out[:, tok.encode("a")] == 0).all())  # every row masked as its own ("a" allowed after each)
    assert list(proc.paths.paths) == [tuple(row[len(prompt):]) for row in rows[-kept:]]


def test_masks_are_computed_ahead_only_with_a_core_to_spare(monkeypatch):
    """Beside a pass that uses every core, a mask thread takes a core from it (measured slower)."""
    from decodekit.samplers import constraint as constraint_module

    from decodekit.models.threads import GOVERNOR

    proc = constraint_processor({"regex": "ab"}, CharTokenizer(96))
    threads = GOVERNOR.full_count()  # what passes use on a quiet machine, not what the last pass used
    for cores, ahead in ((threads, False), (threads + 1, True)):
        monkeypatch.setattr(constraint_module, "usable_cores", lambda: cores)
        assert proc.looks_ahead is ahead


def test_bad_constraints_are_one_clear_line(engine):
    for spec, match in (({"regex": "[0-9"}, "^invalid regex constraint"), ({"json_schema": '{"type": 5}'}, "^invalid json schema"),
                        ({"json_schema": "{not json"}, "^the JSON schema is not valid JSON"), ({"choice": []}, "non-empty list"),
                        ({"regex": ""}, "regex constraint needs a non-empty string"),
                        ({"grammar": ""}, "grammar constraint needs a non-empty string"),
                        ({"grammar": "start: foo"}, "^invalid grammar constraint"), ({"xml": "x"}, "constraint kind must be"),
                        ({"regex": r"[^\s\S]"}, "^invalid regex constraint: no text can continue"),  # matches nothing
                        # a lone surrogate (undecodable bytes, a JSON "\ud800") is no text llguidance can take
                        ({"regex": "a\ud800"}, "^a regex constraint is not valid UTF-8 text .*position 1"),
                        ({"choice": ["a", "\udcff"]}, "^a choice constraint is not valid UTF-8"),
                        ({"grammar": 'start: "\ud800"'}, "^a grammar constraint is not valid UTF-8"),
                        # a schema's, as a dict (what a server request holds) or as JSON text escaping it
                        ({"json_schema": {"properties": {"\ud800": {"type": "string"}}}}, "^a json schema constraint is not valid UTF-8"),
                        ({"json_schema": '{"enum": ["\\ud800"]}'}, "^a json schema constraint is not valid UTF-8"),
                        # nested past what Python's json reads or writes: as text (a file, guided_json) or a dict
                        ({"json_schema": '{"items":' * 5000 + "{}" + "}" * 5000}, "^the JSON schema is nested too deeply$"),
                        ({"json_schema": functools.reduce(lambda inner, _: {"items": inner}, range(5000), {})},
                         "^the JSON schema is nested too deeply$")):
        with pytest.raises(InvalidParameter, match=match) as err:
            engine.generate("hi", max_new_tokens=4, chat=False, constraint=spec)
        assert "\n" not in str(err.value)
    # a pattern's parse error names its cause, which llguidance gives on a later line
    for spec, cause in (({"regex": "("}, "unclosed group"), ({"regex": "a{2,1}"}, "invalid repetition count range"),
                        ({"json_schema": {"type": "string", "pattern": "("}}, "unclosed group")):
        with pytest.raises(InvalidParameter, match=f"^invalid .* constraint: .*regex parse error: {cause}") as err:
            engine.generate("hi", max_new_tokens=4, chat=False, constraint=spec)
        assert "\n" not in str(err.value)
        with pytest.raises(InvalidParameter, match=f"regex parse error: {cause}"):  # the CLI's check
            checked_grammar(spec)
    with pytest.raises(InvalidParameter, match="constraint must be a Constraint or a dict"):
        Constraint.coerce("json")
    # a long pattern is not echoed whole: its start and its length
    with pytest.raises(InvalidParameter, match=r'^invalid regex constraint: .*"\(a{59}\.\.\." \(3001 characters\).*unclosed group') as err:
        checked_grammar({"regex": "(" + "a" * 3000})
    assert len(str(err.value)) < 300


def test_cli_flags_constrain_and_refuse_in_one_line(capsys):
    from decodekit.interfaces.cli import main

    assert main(["generate", "hi", "--regex", "[0-9", "--model", "/no/such"]) == 2  # checked before the model
    assert main(["generate", "hi", "--choice", "a", "--regex", "b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("decodekit: error: invalid regex constraint") and "not allowed with" in err[1]


@pytest.mark.real_model
def test_real_model_json_schema_output_is_valid(real_model, monkeypatch):
    engine = Engine(real_model)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = "Give the name and age of a person called Ann, aged 31, as JSON."
    sampled = {"temperature": 0.8, "seed": 4}
    runs = [("greedy", {}), ("pld", {}), ("sample", sampled), ("pld", sampled)]

    def outputs() -> list[list[int]]:
        tokens = []
        for method, options in runs:
            g = engine.generate(prompt, method=method, max_new_tokens=60, constraint={"json_schema": schema}, **options)
            jsonschema.validate(json.loads(g.text), schema)
            tokens.append(g.tokens)
        return tokens

    from decodekit.samplers.constraint import ConstrainedTokens

    chosen_first = outputs()
    monkeypatch.setattr(ConstrainedTokens, "surely_allows", lambda self, token, history: False)  # a mask at every step
    masked = outputs()
    assert chosen_first == masked and masked[0] == masked[1] and masked[2] == masked[3]


def test_an_output_that_breaks_its_constraint_is_an_error_not_a_result(engine, monkeypatch):
    """The loop checks the finished tokens against the constraint: a masking bug (here: masks
    never applied) raises instead of handing back text the constraint forbids."""
    from decodekit.samplers.constraint import ConstrainedTokens

    monkeypatch.setattr(ConstrainedTokens, "__call__", lambda self, logits, histories: logits)
    monkeypatch.setattr(ConstrainedTokens, "greedy_choice", lambda self, logits, history: int(logits.argmax()))
    with pytest.raises(RuntimeError, match="breaks its choice constraint"):
        for prompt in ("hello", "abcabc", "Q: "):
            engine.generate(prompt, max_new_tokens=12, chat=False, constraint={"choice": CHOICES})


@pytest.mark.parametrize("method", ["greedy", "pld"])
def test_ignore_eos_stops_where_the_grammar_ends(engine, method):
    """``ignore_eos`` decodes past end-of-sequence tokens, but a constraint allows one only where
    its grammar is complete and then nothing else: the output ends there, as without the flag."""
    for prompt in ("hello", "abcabc"):
        plain = engine.generate(prompt, method=method, max_new_tokens=30, chat=False, constraint={"choice": CHOICES})
        ignoring = engine.generate(prompt, method=method, max_new_tokens=30, chat=False, constraint={"choice": CHOICES},
                                   ignore_eos=True)
        assert (ignoring.text, ignoring.finish_reason) == (plain.text, "eos")
        assert ignoring.text in CHOICES


@pytest.fixture(scope="module")
def bpe_engine(tmp_path_factory) -> Engine:
    """The tiny model under a byte-level BPE vocabulary with special tokens, read from a
    tokenizer.json as the embedded model's is (llguidance then spells text with them)."""
    from tests.test_tokenizer import tokenizer_folder
    from decodekit.models.tokenizer import file_tokenizer

    tokenizer = file_tokenizer(tokenizer_folder(tmp_path_factory.mktemp("bpe")))
    return Engine(LoadedModel(tiny_llama(seed=0, vocab_size=tokenizer.grammar_tokenizer().vocab_size), tokenizer, "tiny"))


@pytest.mark.parametrize("method", ["greedy", "pld"])
def test_text_only_a_special_token_could_spell_is_one_line(bpe_engine, method):
    """llguidance spells text with special tokens too ("<|im_end|>"), which decode to no text: a
    mask never allows one but for the end of the text, so a constraint that can only go on as a
    special token's text is one line, never an empty or unmasked output; where ordinary tokens
    may spell that text, they do."""
    tokenizer = bpe_engine.model.tokenizer
    special = tokenizer.special_tokens()
    assert set(special.values()) == {"<s>", "</s>", "<unk>", "<|im_end|>"}
    for spec, name in (({"regex": r"<\|im_end\|>x"}, "<|im_end|>"), ({"choice": ["<s>"]}, "<s>")):
        with pytest.raises(InvalidParameter, match=rf"^structured decoding failed: .*special token \({re.escape(name)}\)") as err:
            bpe_engine.generate("the", method=method, max_new_tokens=12, chat=False, constraint=spec)
        assert "\n" not in str(err.value)
    for seed in range(4):
        g = bpe_engine.generate("the", method="sample", seed=seed, max_new_tokens=30, chat=False,
                                constraint={"regex": "(the|<s>) (mat|<unk>)"})
        assert re.fullmatch("(the|<s>) (mat|<unk>)", g.text) and g.finish_reason == "eos"
        assert not set(g.tokens) & set(special)


def test_a_matcher_error_outside_the_mask_is_one_line_not_an_unmasked_row(engine):
    """A grammar whose text never ends makes llguidance's forced-text computation give up; the
    matcher's error state is then an error, not a row taken as refused and sampled unmasked."""
    with pytest.raises(InvalidParameter, match=r"^structured decoding failed: ") as err:
        engine.generate("hi", max_new_tokens=6, chat=False, constraint={"grammar": 'start: a\na: "x" a\n'})
    assert "\n" not in str(err.value)


def test_a_json_constraint_means_any_json_object_and_takes_no_schema():
    tok = CharTokenizer(96)
    proc = constraint_processor({"json": None}, tok)
    for text in ('{"a": [1, "x"]}', "{}"):
        assert proc.allowed_prefix([], tok.encode(text)) == len(text), text
    for text in ("[1]", '"x"', "12", "null"):  # JSON, but not an object
        assert proc.allowed_prefix([], tok.encode(text)) == 0, text
    with pytest.raises(InvalidParameter, match="takes no value; for a schema use json_schema"):
        Constraint.coerce({"json": {"type": "integer"}})


@pytest.mark.parametrize("schema, where", [
    ({"const": 2**53 + 1}, "const at /"),
    ({"type": "integer", "minimum": 2**64}, "minimum at /"),
    ({"type": "object", "properties": {"id": {"enum": ["a", [1, 10**20]]}}}, "enum at /properties/id"),
    ('{"const": 1e400}', "const at / holds inf"),  # JSON text whose literal overflows a float
    ('{"type": "string", "maxLength": 1e400}', "maxLength at / holds inf"),  # llguidance said "got null"
    ({"type": "array", "minItems": 2**60}, "minItems at /"),
    ({"properties": {"const": {"maximum": 2**60}}}, "maximum at /properties/const"),  # a property named const
    ({"anyOf": [{"type": "string"}, {"type": "integer", "maximum": 2**60}]}, "maximum at /anyOf/1"),  # a list of subschemas
])
def test_a_schema_number_llguidance_would_round_is_refused(schema, where):
    """llguidance reads a schema's numbers as float64: 2**53 + 1 decoded as 2**53 broke the schema
    while the output ended as if it were valid."""
    with pytest.raises(InvalidParameter, match=re.escape(where)):
        Constraint("json_schema", schema).grammar()


def test_boolean_schemas_and_numbers_a_float_holds_exactly():
    for schema in (True, {"const": 2**53}, {"enum": [-(2**53), 0.5]}, {"properties": {"maximum": {"type": "string"}}}):
        checked_grammar({"json_schema": schema})
    with pytest.raises(InvalidParameter, match="false allows no value"):
        Constraint("json_schema", False).grammar()
    with pytest.raises(InvalidParameter, match="a JSON object or a boolean, got list"):
        Constraint("json_schema", [1]).grammar()


def test_a_mask_computed_ahead_is_found_by_a_wait_repeated_after_an_interrupt():
    """A Ctrl-C can land just after a wait for a mask took its wake-up: the outcome stays with the
    computation, so the repeated wait returns it instead of waiting for ever; a worker's error is
    raised in the caller; and the workers take work through a queue whose put holds no lock they need."""
    from decodekit.samplers.constraint import MaskWorkers

    workers = MaskWorkers(1)
    pending = workers.submit(lambda a, b: a + b, 2, 3)
    pending.woken.get(timeout=30)  # the interrupted wait: its wake-up taken, its result never read
    assert pending.result() == 5
    failing = workers.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result()
    assert workers.submit(len, "abc").result() == 3  # the worker goes on


@pytest.mark.parametrize("prompt", ["hello", "abcabc", "Q: "])
def test_the_constraint_masks_before_every_other_processor(engine, prompt):
    """The constraint runs first: top_k=1 then keeps the likeliest token the grammar allows (the
    constrained greedy choice), where top-k first could leave only a token the grammar refuses."""
    greedy = engine.generate(prompt, max_new_tokens=20, chat=False, constraint={"choice": CHOICES})
    top1 = engine.generate(prompt, method="sample", top_k=1, seed=0, max_new_tokens=20, chat=False,
                           constraint={"choice": CHOICES})
    assert top1.text in CHOICES and top1.tokens == greedy.tokens


def test_numbers_outside_the_keywords_that_bound_values_are_not_refused():
    """Only the keywords that bound or spell a value (const, enum, minimum, ...) decide the output;
    an annotation's big number (a default, an example) changes nothing llguidance decodes."""
    for schema in ({"type": "integer", "minimum": 0, "default": 2**60}, {"type": "integer", "examples": [2**60, 1e400]}):
        checked_grammar({"json_schema": schema})


def test_a_choice_constraint_refuses_an_empty_choice():
    """An empty string among the choices would let the output be empty: refused in one line."""
    with pytest.raises(InvalidParameter, match="non-empty list of non-empty strings"):
        Constraint("choice", ["yes", ""])


def test_choices_are_matched_literally_not_as_patterns():
    """A choice is its own text: "a+b" allows exactly "a+b", not "aab" as the regex a+b would."""
    tok = CharTokenizer(96)
    proc = constraint_processor({"choice": ["a+b", "c.d"]}, tok)
    assert proc.broken_by(tok.encode("a+b")) is None and proc.broken_by(tok.encode("c.d")) is None
    assert proc.broken_by(tok.encode("aab")) is not None and proc.broken_by(tok.encode("cxd")) is not None
    for _ in range(2):  # asked again, a refused row is still refused, and a row continuing its taken part too
        assert proc.broken_by(tok.encode("aab")) is not None and proc.broken_by(tok.encode("aab+")) is not None
    assert proc.broken_by(tok.encode("a+")) is None and proc.forced(tok.encode("a")) == tok.encode("+b")


def test_a_choice_the_vocabulary_cannot_write_is_refused_before_decoding():
    """A choice with a character no token writes (here "é", which the character tokenizer lacks)
    would reach a dead end inside it: refused in one line naming it, before any token is decoded."""
    tok = CharTokenizer(96)
    with pytest.raises(InvalidParameter, match="choice 'café' cannot be written with this model's tokens"):
        constraint_processor({"choice": ["cafe", "café"]}, tok)
    assert constraint_processor({"choice": ["cafe", "tea"]}, tok).broken_by(tok.encode("tea")) is None


@pytest.mark.parametrize("method", ["greedy", "pld"])
@pytest.mark.parametrize("constraint", [{"regex": "café|thé"}, {"json_schema": {"enum": ["café", "thé"]}}])
def test_a_constraint_that_needs_text_no_token_writes_is_one_line_not_a_bug(constraint, method):
    """Where decoding reaches a dead end (after "th" only "é" may follow, which no token writes), the
    output breaks the constraint through no fault of decoding: one InvalidParameter line saying
    where, plainly and speculatively alike, not the "decodekit bug" error of an output that broke a
    grammar its tokens could follow."""
    engine = Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))
    with pytest.raises(InvalidParameter, match=r"after '\"?th' the .* constraint needs text that no token of this model"):
        engine.generate("abc", constraint=constraint, max_new_tokens=8, chat=False, method=method)


@pytest.mark.parametrize("method, options", [("beam", {"n": 2}), ("best-of-n", {"n": 3, "temperature": 1.0, "seed": 0})])
def test_a_search_that_reaches_a_dead_end_is_one_line_not_an_answer_that_breaks_it(engine, method, options):
    """A search's rows go on past a mask that allows no token (a row the grammar refused is left
    unmasked, as a verification's is): its answer is checked as plain decoding's is, so the dead end
    is one line, never text that breaks the constraint handed back as an answer."""
    for constraint in ({"regex": "café|thé"}, {"json_schema": {"enum": ["café", "thé"]}}):
        with pytest.raises(InvalidParameter, match=r"the .* constraint needs text that no token of this model"):
            engine.generate("abc", method=method, constraint=constraint, max_new_tokens=8, chat=False, **options)


def test_an_output_that_breaks_a_followable_constraint_is_still_a_bug():
    """The dead-end check does not excuse an output that left the grammar where tokens could go on."""
    tok = CharTokenizer(96)
    proc = constraint_processor({"regex": "cafe|the"}, tok)
    assert proc.broken_by(tok.encode("thx")) == "the output breaks its regex constraint"


def test_no_draft_is_allowed_after_a_path_the_grammar_refuses():
    """``allowed_prefix`` after generated tokens the grammar refuses is 0: nothing can follow a broken path."""
    tok = CharTokenizer(96)
    proc = constraint_processor({"regex": "[ab]+"}, tok)
    a, b, c = tok.encode("abc")
    assert proc.allowed_prefix([a], [b, a]) == 2
    assert proc.allowed_prefix([c], [a, b]) == 0
    assert proc.allowed_prefix([a, c], [a]) == 0


def test_a_choice_before_the_mask_never_asks_the_matcher_about_an_id_it_lacks():
    """``surely_allows`` of an id outside the grammar's vocabulary (the first past it, a negative one)
    is False without asking llguidance, whose matcher goes into its error state on one (or raises)."""
    tok = CharTokenizer(96)
    proc = constraint_processor({"regex": "[ab]+"}, tok)
    prompt = tok.encode("zz")
    history = Histories([prompt + tok.encode("a")], len(prompt))
    for token in (proc.vocab, -1):
        assert proc.surely_allows(token, history) is False
        assert not any(m.is_error() for m in proc.paths.matchers())
    assert proc.surely_allows(tok.encode("b")[0], history) is True


def test_a_wait_repeated_after_the_outcome_came_returns_at_once():
    """Once a computation's outcome is there, every later wait returns it (the single wake-up is not
    waited for again): a mask computed ahead may be asked for twice."""
    import threading

    from decodekit.samplers.constraint import MaskWorkers

    pending = MaskWorkers(1).submit(lambda: 7)
    assert pending.result() == 7
    answers: list[int] = []
    again = threading.Thread(target=lambda: answers.append(pending.result()), daemon=True)
    again.start()
    again.join(timeout=30)  # a deadlock guard, not a timing: the wait must not block
    assert answers == [7]


def test_an_interrupted_wait_for_masks_computed_ahead_is_waited_for_again(monkeypatch):
    """A wait for prepared masks interrupted before they came (Ctrl-C) leaves them pending: the next
    call waits for them and takes them, instead of using the matcher beside the worker that still
    has it."""
    import threading

    tok = CharTokenizer(96)
    prompt = tok.encode("zz")
    rows = [prompt + tok.encode(t) for t in ("a", "b", "ab")]
    want = constraint_processor({"regex": "ab|ac|bd"}, tok)(torch.zeros(len(rows), 96), Histories(rows, len(prompt)))
    proc = constraint_processor({"regex": "ab|ac|bd"}, tok)
    gate = threading.Event()
    threads = record_mask_threads(monkeypatch, gate)
    proc.prepare([r[len(prompt):] for r in rows])
    pending, waits = proc._ahead, []

    class Interrupted:  # the computation, whose first wait is interrupted while the worker still computes
        @property
        def outcome(self):
            return pending.outcome

        def result(self):
            waits.append(1)
            if len(waits) == 1:
                raise KeyboardInterrupt
            return pending.result()

    proc._ahead = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        proc(torch.zeros(len(rows), 96), Histories(rows, len(prompt)))
    gate.set()
    assert torch.equal(proc(torch.zeros(len(rows), 96), Histories(rows, len(prompt))), want)
    assert len(waits) == 2 and threads and "MainThread" not in threads  # every mask was the worker's



def test_a_forced_chain_is_at_most_max_draft_tokens(engine, monkeypatch):
    """Forced text is drafted whatever the controller's budget, but within its ``max_draft`` cap:
    with a cap of 3 the eight fixed characters come in chains of at most three."""
    verified = record_verified_tree_sizes(monkeypatch)
    plain = engine.generate("xyz", max_new_tokens=20, chat=False, constraint={"regex": FIXED})
    got = engine.generate("xyz", method="pld", max_draft=3, budget=0, max_new_tokens=20, chat=False,
                          constraint={"regex": FIXED})
    assert got.tokens == plain.tokens
    assert max(verified) == 3 and got.stats.extra["forced_drafted"] == sum(verified)


def test_forced_steps_teach_the_controller_nothing(engine, monkeypatch):
    """The controller's acceptance statistics leave forced chains out: they say nothing of the drafter's."""
    from decodekit.speculative.controller import Controller

    taught: list[list[str]] = []
    observe = Controller.observe

    def recording(self, tree, verdict, overhead_s):
        taught.append(list(tree.source or []))
        observe(self, tree, verdict, overhead_s)

    monkeypatch.setattr(Controller, "observe", recording)
    got = engine.generate("xyzxyz", method="pld", cost_table={1: 1.0, 64: 1.0}, max_new_tokens=20, chat=False,
                          constraint={"regex": FIXED})
    assert got.stats.extra["accepted_by_source"]["forced"] > 0
    assert not any("forced" in sources for sources in taught), taught


@pytest.mark.parametrize("method", ["suffix", "lookahead"])
def test_a_long_constrained_output_keeps_only_the_matchers_of_its_last_rows(engine, method, monkeypatch):
    """Each kept matcher holds parser state for every token of its row: the paths no call asked about
    since the one before are dropped, so a long speculative output does not keep its dead branches."""
    from decodekit.samplers import constraint as constraint_module

    made: list = []
    init = constraint_module.MatcherPaths.__init__
    monkeypatch.setattr(constraint_module.MatcherPaths, "__init__",
                        lambda self, *args: init(self, *args) or made.append(self))
    schema = {"type": "array", "items": {"type": "string"}}
    plain = engine.generate("abc abc abc", max_new_tokens=200, chat=False, constraint={"json_schema": schema})
    got = engine.generate("abc abc abc", method=method, max_new_tokens=200, chat=False, constraint={"json_schema": schema})
    assert got.tokens == plain.tokens and len(got.tokens) == 200
    paths = made[-1]
    assert paths.call > 20 and len(paths.paths) <= 8, (paths.call, sorted(len(k) for k in paths.paths))


def test_choices_may_be_a_tuple():
    """A choice constraint takes any list of strings, a tuple as well (the documented list or tuple)."""
    c = Constraint.coerce({"choice": ("yes", "no")})
    assert c.kind == "choice" and tuple(c.value) == ("yes", "no")
    assert Constraint("choice", ("a",)).value == ("a",)


def test_a_dict_with_several_kinds_is_refused_clearly():
    """A constraint is one kind: a dict naming two is the library's InvalidParameter, not a ValueError
    from unpacking it."""
    with pytest.raises(InvalidParameter, match="constraint must be a Constraint or a dict"):
        Constraint.coerce({"regex": "a", "choice": ["b"]})
    with pytest.raises(InvalidParameter, match="constraint must be a Constraint or a dict"):
        Constraint.coerce({})


@pytest.mark.parametrize("schema, where", [
    ({"type": "integer", "minimum": -(2**53) - 1}, "minimum at /"),
    ({"enum": [0, -(2**64)]}, "enum at /"),
])
def test_a_negative_schema_number_past_2_53_is_refused(schema, where):
    """float64 holds every integer of magnitude <= 2**53 and not all beyond, on either side of 0."""
    with pytest.raises(InvalidParameter, match=where):
        Constraint("json_schema", schema).grammar()


def test_a_finished_answer_is_checked_against_the_schema_itself():
    """llguidance's grammar for an exclusive bound lets the bound itself through (0 for
    exclusiveMinimum 0 below a maximum under 1): such an answer is an error naming the schema's
    rule, never a result; every answer returned is valid against the schema."""
    import jsonschema

    from decodekit.samplers.constraint import schema_refusal

    assert "less than or equal to the minimum of 0" in schema_refusal({"type": "number", "exclusiveMinimum": 0}, "0")
    assert "greater than or equal to the maximum of 0" in schema_refusal({"exclusiveMaximum": 0}, "-0")
    assert schema_refusal({"type": "object"}, "{") == "it is not JSON"
    assert schema_refusal({"type": "number", "multipleOf": 0.01}, "0.57") is None  # not judged in floating point
    assert schema_refusal({"type": "string", "format": "date"}, '"soon"') is None
    assert schema_refusal({"type": "object", "required": ["a"]}, '{"a": 1}') is None
    engine = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64), CharTokenizer(96), "tiny"))
    schema = {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}
    refused = 0
    for seed in range(12):
        try:
            out = engine.generate("p", max_new_tokens=12, constraint={"json_schema": schema}, method="sample",
                                  temperature=1.0, seed=seed)
        except InvalidParameter as err:
            assert "breaks the JSON schema, which llguidance's grammar for it let through" in str(err)
            refused += 1
            continue
        if out.finish_reason == "eos":
            jsonschema.validate(json.loads(out.text), schema)
    assert refused > 0


@pytest.mark.parametrize("option", ["lenient", "coerce_one_of", "item_separator", "key_separator"])
def test_llguidance_options_that_break_a_schema_are_refused(option):
    from decodekit.samplers.constraint import Constraint

    schema = {"x-guidance": {option: ";"}, "type": "array", "items": {"enum": ["a"]}, "uniqueItems": True}
    with pytest.raises(InvalidParameter, match=f"x-guidance option {option} lets llguidance write what the schema refuses"):
        Constraint("json_schema", schema).grammar()
    assert Constraint("json_schema", {"x-guidance": {"whitespace_flexible": False}, "type": "object"}).grammar()


def test_a_json_integer_longer_than_pythons_str_limit_is_json():
    """Python's int() refuses more than 4300 digits and json.loads reports that as no JSON: a model
    writing digit after digit under {"type": "integer"} gave a valid answer, refused as not JSON."""
    from decodekit.samplers.constraint import schema_refusal, whole_number

    assert whole_number("1" * 9000) == (10**9000 - 1) // 9
    assert whole_number("-" + "9" * 4001) == -(10**4001 - 1)
    assert whole_number("0") == 0 and whole_number("-12") == -12
    assert schema_refusal({"type": "integer"}, "1" * 4301) is None
    assert schema_refusal({"type": "object"}, '{"a": -' + "7" * 5000 + "}") is None
    assert schema_refusal({"type": "integer", "maximum": 5}, "1" * 9000) == "it breaks the schema at an integer too long to quote"
    assert schema_refusal({"type": "integer"}, "1" * 9000 + "x") == "it is not JSON"
