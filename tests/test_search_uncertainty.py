"""Uncertainty signals and the judge scorer on hand-made inputs."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tokenizer import Tokenizer
from decodekit.models.tiny import tiny_llama
from decodekit.search.answers import answer_start, extract_auto, extract_line, extract_number, extractor, normalize_text
from decodekit.search.batch import Sample
from decodekit.search.scorers import Judge
from decodekit.search.uncertainty import agreement, first_content_index, normalized_entropy, phi_first, sample_signals
from decodekit.samplers import Histories, Sampler, Temperature

TOK = CharTokenizer(96)


def test_the_first_content_token_after_a_lead_in_is_found_without_decoding_the_whole_answer():
    """Only the prefixes up to the first token ending past the lead-in are decoded (a decode per
    token of the whole answer made phi_first quadratic in a long answer's length)."""
    calls = []

    class Counting:
        def decode(self, tokens):
            calls.append(len(tokens))
            return TOK.decode(tokens)

    tokens = TOK.encode("The answer is 42." + " and more" * 300)
    assert first_content_index(tokens, Counting(), start_char=len("The answer is ")) == len("The answer is ")
    assert max(calls) <= len("The answer is 4") and len(calls) <= 2 * len("The answer is 4")


def test_normalized_entropy_on_hand_made_distributions():
    assert normalized_entropy([0.0] * 10) == pytest.approx(1.0)
    assert normalized_entropy([50.0] + [0.0] * 9) == pytest.approx(0.0, abs=1e-12)
    two = [0.0, 0.0] + [-float("inf")] * 8  # two equally likely tokens among K = 10
    assert normalized_entropy(two) == pytest.approx(math.log(2) / math.log(10))


def test_phi_first_skips_whitespace_and_punctuation_and_the_lead_in():
    tokens = TOK.encode(" .Ab 7")
    flat, sharp = [0.0] * 10, [30.0] + [0.0] * 9
    sample = Sample(tokens, [0.0] * 6, [0.0] * 6, [0.0] * 6, [sharp, sharp, flat, flat, sharp, sharp], "eos")
    assert first_content_index(tokens, TOK) == 2
    assert phi_first(sample, TOK) == pytest.approx(1.0)  # at "A"
    # the lead-in " .Ab" ends at character 4: "b", ending there, is part of it; the answer is "7"
    assert phi_first(sample, TOK, start_char=4) == pytest.approx(0.0, abs=1e-9)
    assert phi_first(sample, TOK, start_char=3) == pytest.approx(1.0)  # at "b"
    assert phi_first(Sample(TOK.encode(" ."), [0, 0], [0, 0], [0, 0], [flat, flat], "eos"), TOK) is None


class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte, as byte-level BPE spells a character it has no token for: a piece
    of a character decodes, on its own, to U+FFFD."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", "replace")


@pytest.mark.parametrize("lead, answer", [(" ", "\u4e1c\u4eac"), ("\U0001f600 ", "\u041e\u0442\u0432\u0435\u0442"),
                                          ("\u3002", "\u00e9t\u00e9")])
def test_the_first_content_token_may_hold_only_part_of_its_character(lead, answer):
    """A letter spelled in byte tokens is content from its first byte: phi_first of "东京" or "Ответ" is
    read where the answer's first letter is chosen, not at a later letter or nowhere. Bytes of an
    emoji or of an ideographic full stop hold no letter, and are skipped."""
    tok = ByteTokenizer()
    tokens = tok.encode(lead + answer)
    assert first_content_index(tokens, tok) == len(lead.encode("utf-8"))
    assert first_content_index(tokens, tok, start_char=len(lead)) == len(lead.encode("utf-8"))
    flat, sharp = [0.0] * 10, [30.0] + [0.0] * 9
    n = len(tokens)
    topk = [sharp] * n
    topk[len(lead.encode("utf-8"))] = flat
    assert phi_first(Sample(tokens, [0.0] * n, [0.0] * n, [0.0] * n, topk, "eos"), tok) == pytest.approx(1.0)
    assert first_content_index(tok.encode("\U0001f600\u3002"), tok) is None


def test_answer_extraction_modes():
    assert extract_number("it costs $1,250.50 in total, not 3.") == "3"
    assert extract_number("so the answer is 1,250.") == "1250"
    assert extract_number("x = 12.0") == "12"
    assert extract_number("no digits") is None
    # a hyphen after a digit or letter is a range or a date, not a minus sign; the minus sign is
    # one wherever else it stands, as Unicode's too; a leading point, leading zeros
    cases = {"read pages 3-4": "4", "on 2024-05-06": "6", "x = -5": "-5", "x=\u22125": "-5", "3 - 4 = -1": "-1",
             "about .5 of it": "0.5", "-.25": "-0.25", "agent 007": "7", "0.50": "0.5", "-0.0": "0", "10 - 4": "4",
             "COVID-19": "19", "see item-5": "5"}
    assert {text: extract_number(text) for text in cases} == cases
    # commas only between groups of three digits; a sign before a dollar sign; no number cut out of a
    # longer run of digits and dots
    cases = {"1,2,3": "3", "1,000,000 apples": "1000000", "a loss of -$5": "-5", "$-5": "-5", "it is $3.50.": "3.5",
             "version 1.5.2": "1.5", "10,000.00": "10000", "12,34": "34", "so...42": "42"}
    assert {text: extract_number(text) for text in cases} == cases
    # digits of any script are the same number as ASCII ones (so a vote or a gold answer matches them)
    cases = {"ﬁnal \uff14\uff12": "42", "\u0664\u0662 \u0641\u0642\u0637": "42", "\uff11,\uff10\uff10\uff10.\uff15\uff10": "1000.5"}
    assert {text: extract_number(text) for text in cases} == cases
    assert answer_start("it is $3.50.", "number") == len("it is $")
    assert extract_line("\n  Bogotá, Colombia!\nmore") == "bogota colombia"
    assert extract_auto("The answer: 42") == "42" and extract_auto("Paris.") == "paris"
    assert normalize_text("  São   PAULO ") == "sao paulo"
    assert answer_start("total is 42.", "number") == 9 and answer_start("Paris", "line") == 0


def test_auto_answers_start_at_the_last_number_when_there_is_one():
    """auto is the last number when there is one (so its answer starts there), else the first line (at 0)."""
    assert answer_start("total is 42.", "auto") == answer_start("total is 42.", "number") == 9
    assert answer_start("so -3 it is", "auto") == 3
    assert answer_start("Paris", "auto") == 0


def test_an_answer_start_callable_may_point_at_the_texts_end():
    """answer_start returns an offset in [0, len(text)]: the end itself is one (an empty answer)."""
    from decodekit.errors import InvalidParameter
    from decodekit.search.answers import answer_functions

    _, start = answer_functions("auto", lambda text: len(text))
    assert start("abc") == 3
    _, start = answer_functions("auto", lambda text: len(text) + 1)
    with pytest.raises(InvalidParameter, match=r"answer_start callable must return an offset in \[0, 3\]"):
        start("abc")


def test_a_samples_own_signals_are_means_over_its_tokens():
    sample = Sample(TOK.encode("ab"), [-1.0, -3.0], [0.5, 1.5], [0.2, 0.4], [[0.0] * 4] * 2, "length")
    signals = sample_signals(sample, TOK)
    assert signals == pytest.approx({"phi_first": 1.0, "self_certainty": 1.0, "mean_logprob": -2.0, "margin": 0.3})


def test_prob_and_self_certainty_scorers_are_means_over_the_tokens():
    """prob is exp(mean log-prob) (Wang et al.'s normalised weight, EOS counted as a token);
    self-certainty the mean of the per-token KL(U || p) (Kang et al.), not sums."""
    from decodekit.search.scorers import Probability, SelfCertainty

    sample = Sample(TOK.encode("ab"), [-1.0, -3.0], [0.5, 1.5], [0.2, 0.4], [[0.0] * 4] * 2, "eos", eos_logprob=-2.0)
    assert Probability().score(None, [], sample) == pytest.approx(math.exp(-6.0 / 3))
    assert SelfCertainty().score(None, [], sample) == pytest.approx(1.0)


def test_mean_logprob_scorer_is_the_loglik_per_choice():
    """mean-logprob is loglik over the choices, EOS counted (loglik -6 over 3 choices), not the sum."""
    from decodekit.search.scorers import LogLikelihood, MeanLogprob

    sample = Sample(TOK.encode("ab"), [-1.0, -3.0], [0.5, 1.5], [0.2, 0.4], [[0.0] * 4] * 2, "eos", eos_logprob=-2.0)
    assert LogLikelihood().score(None, [], sample) == pytest.approx(-6.0)
    assert MeanLogprob().score(None, [], sample) == pytest.approx(-2.0)


def test_agreement_is_the_share_of_equal_answers():
    assert agreement("a", ["a", "b", "a", None]) == 0.5
    assert agreement(None, ["a"]) is None


def test_sampling_inserts_temperature_only_for_greedy_samplers():
    greedy = Sampler.from_params(greedy=True, seed=3, top_k=5, repetition_penalty=1.2)
    s = greedy.sampling(0.7)
    assert not s.is_greedy and s.seed == 3
    names = [type(p).__name__ for p in s.processors]
    assert names == ["RepetitionPenalty", "Temperature", "TopK"]
    assert greedy.sampling(0) is greedy
    # after the penalties: a presence penalty of 1 then T = 0.5 gives (2 - 1) / 0.5 = 2, not 2 / 0.5 - 1 = 3
    hist = Histories([[0]], 0)
    presence = Sampler.from_params(greedy=True, presence_penalty=1.0).sampling(0.5)
    assert presence.process(torch.tensor([[2.0, 1.0, 0.0]]), hist).tolist() == [[2.0, 2.0, 0.0]]
    sampled = Sampler([Temperature(1.3)], seed=1)
    assert sampled.sampling(0.7) is sampled


class WordTokenizer(Tokenizer):
    """Whole words as tokens, so that 'yes' and 'no' are single tokens."""

    WORDS = ["<eos>", "yes", "Yes", "no", "No", "maybe", "Q", "A", "?"]

    def __init__(self):
        self.eos_token_ids = frozenset({0})

    def encode(self, text):
        return [self.WORDS.index(w) for w in text.split() if w in self.WORDS]

    def decode(self, ids):
        return " ".join(self.WORDS[i] for i in ids if i)


def test_judge_score_is_the_yes_share_of_yes_plus_no():
    model = LoadedModel(tiny_llama(seed=0, vocab_size=9), WordTokenizer(), "words")
    logits = torch.tensor([0.0, 1.0, 0.5, 0.2, -1.0, 3.0, 0.0, 0.0, 0.0])
    p = torch.softmax(logits, -1)
    expected = float((p[1] + p[2]) / (p[1] + p[2] + p[3] + p[4]))
    assert Judge.yes_share(model, logits) == pytest.approx(expected, abs=1e-6)


def test_the_judge_counts_only_single_token_spellings_of_yes_and_no():
    """Only a token that is a whole "yes" or "no" answers: with one token a character, none is, and
    the share is the neutral 0.5 however likely "y" or "n" (the first tokens of the words) are."""
    from decodekit.models import CharTokenizer

    tok = CharTokenizer(96)
    model = LoadedModel(tiny_llama(seed=0), tok, "tiny")
    logits = torch.zeros(96)
    logits[tok.encode("y")[0]] = 5.0
    logits[tok.encode("N")[0]] = 1.0
    assert Judge.yes_share(model, logits) == 0.5


def test_the_judge_reads_a_step_after_the_prompt_and_the_earlier_steps():
    """A step is judged in its conversation: prompt, earlier steps, the step, then the question;
    the score is the yes share of the next-token distribution there (here against a fresh prefill)."""
    from decodekit.engine import make_sampler
    from decodekit.engine.core import Request
    from decodekit.search.batch import Sample, SearchContext

    model = LoadedModel(tiny_llama(seed=0, vocab_size=9), WordTokenizer(), "words")
    ctx = SearchContext(model, Request([6, 8], make_sampler("best-of-n", {}), 8))  # "Q ?"
    prefix, step = [7, 5, 5], [7]  # "A maybe maybe", "A"
    got = Judge().score_step(ctx, prefix, Sample(step, [0.0], [], [], [], "step"))
    ids = ctx.prompt + prefix + step + Judge._follow_up(model, Judge.STEP_QUESTION)
    want = Judge.yes_share(model, tiny_llama(seed=0, vocab_size=9).prefill(ids)[0])
    assert got == pytest.approx(want, abs=1e-6)
    alone_ids = ctx.prompt + step + Judge._follow_up(model, Judge.STEP_QUESTION)
    alone = Judge.yes_share(model, tiny_llama(seed=0, vocab_size=9).prefill(alone_ids)[0])
    assert abs(want - alone) > 1e-4  # (the earlier steps change the answer here)


def test_the_judges_question_follows_the_answer_in_the_chat_format():
    """The follow-up closes the answer's turn and asks in a user turn, in the model's chat format,
    without the answer itself (which the ids before it already hold)."""
    from decodekit.models import CharTokenizer

    class Chat(CharTokenizer):
        def chat_prompt(self, messages):
            return "".join(f"<{m['role'][0]}>{m['content']}</{m['role'][0]}>" for m in messages) + "<a>"

    model = LoadedModel(tiny_llama(seed=0), Chat(96), "tiny")
    assert model.tokenizer.decode(Judge._follow_up(model, "Right?")) == "</a><u>Right?</u><a>"
    plain = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")  # no chat template
    assert Judge._follow_up(plain, "Right?") == plain.tokenizer.encode("\n\nRight?\nAnswer:")


@pytest.mark.parametrize("method", ["best-of-n", "weighted-vote", "step-beam", "particle", "astar"])
def test_a_judge_with_another_vocabulary_is_refused_before_any_sample(monkeypatch, method):
    """The judge reads the generating model's token ids, so it must share its tokenizer; said before
    the search decodes anything (not after n samples)."""
    from decodekit.engine import Engine
    from decodekit.errors import InvalidParameter
    from decodekit.models import CharTokenizer
    from decodekit.search.batch import SearchContext

    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    judge = LoadedModel(tiny_llama(seed=0, vocab_size=80), CharTokenizer(80), "small")
    monkeypatch.setattr(SearchContext, "decode", lambda *args, **kwargs: pytest.fail("the search decoded"))
    with pytest.raises(InvalidParameter, match="judge model must share the generating model's tokenizer") as refused:
        Engine(model).generate("hi", method=method, n=2, scorer="judge", judge_model=judge, max_new_tokens=3)
    assert refused.value.param == "judge_model"


def test_a_step_search_asks_the_judge_about_each_step_the_first_included():
    """Every step, the first one too, is asked the step question; a whole answer the answer one."""
    from decodekit.engine import Engine
    from decodekit.models import CharTokenizer

    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    asked = []
    ask = Judge._ask

    def spy(self, ctx, prefix, segment, question):
        asked.append(question)
        return ask(self, ctx, prefix, segment, question)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Judge, "_ask", spy)
        Engine(model).generate("Q: 1+1=", method="step-beam", n=2, expand=2, scorer="judge", delimiter="a",
                               max_step_tokens=4, max_new_tokens=12)
        assert asked and set(asked) == {Judge.STEP_QUESTION}
        asked.clear()
        Engine(model).generate("Q: 1+1=", method="best-of-n", n=2, scorer="judge", max_new_tokens=6)
        assert asked == [Judge.ANSWER_QUESTION] * 2


def test_a_judge_model_decoding_a_request_of_its_own_keeps_its_answer():
    """A search judged by a model that is mid-request (here from that request's own on_text) asks
    a clone of it: the judge's own cache, and so its answer, stay as if no search had run."""
    from decodekit.engine import Engine

    judge = LoadedModel(tiny_llama(seed=0, hidden_size=64), TOK, "judge")
    other = LoadedModel(tiny_llama(seed=1, hidden_size=64), TOK, "other")
    prompt = "hello world " * 8
    alone = Engine(LoadedModel(judge.backend.clone(), TOK, "judge")).generate(prompt, max_new_tokens=30, chat=False)
    searched = []

    def on_text(delta):
        if not searched:  # after the first token: the judge's cache holds the prompt and that token
            searched.append(Engine(other).generate("zq", method="best-of-n", n=2, seed=1, scorer="judge",
                                                   judge_model=judge, max_new_tokens=3, chat=False))

    got = Engine(judge).generate(prompt, max_new_tokens=30, chat=False, on_text=on_text)
    assert searched and got.tokens == alone.tokens


def test_a_judge_loaded_by_name_for_a_request_is_used_and_let_go(monkeypatch):
    """A judge named by the request is loaded for that request alone: it needs no clone, and
    nothing of it stays in the generating model's memory once the request is over."""
    import gc
    import weakref

    import decodekit.models
    from decodekit.engine import Engine

    loaded = []

    def load_model(name):
        loaded.append(LoadedModel(tiny_llama(seed=1, hidden_size=64), TOK, name))
        return loaded[-1]

    monkeypatch.setattr(decodekit.models, "load_model", load_model)
    model = LoadedModel(tiny_llama(seed=0, hidden_size=64), TOK, "tiny")
    Engine(model).generate("zq", method="best-of-n", n=2, seed=1, scorer="judge", judge_model="a-judge",
                           max_new_tokens=3, chat=False)
    assert len(loaded) == 1 and loaded[0].backend.length > 0  # the judge's own cache was used
    judge = weakref.ref(loaded.pop().backend)
    gc.collect()
    assert judge() is None


def test_normalized_text_reads_punctuation_as_a_space():
    """A name hyphenated or not, or a list with or without spaces after its commas, is the same answer."""
    assert normalize_text("Port-au-Prince") == normalize_text("Port au Prince") == "port au prince"
    assert normalize_text("a,b") == normalize_text("a, b") == "a b"
    assert normalize_text("  São  Tomé! ") == "sao tome"


def test_punctuation_of_any_script_reads_as_a_space():
    """A curly apostrophe, an en or em dash, guillemets, curly quotes and an ideographic full stop
    are punctuation as their ASCII forms are: the same answer, however the model typed it, votes
    once and matches its gold."""
    pairs = [("N\u2019Djamena", "N'Djamena"), ("Port\u2013au\u2013Prince", "Port-au-Prince"),
             ("\u00abParis\u00bb", "Paris"), ("\u201cParis\u201d\u3002", '"Paris".'), ("Lima\u2014Peru", "Lima-Peru")]
    for typed, ascii_form in pairs:
        assert normalize_text(typed) == normalize_text(ascii_form), typed
    assert extract_line("The capital is N\u2019Djamena.") == extract_line("The capital is N'Djamena") == "the capital is n djamena"


def test_phi_first_reads_only_the_top_k_logits_it_is_asked_for():
    """phi_first is H(softmax(top-K logits)) / log K with the K given: K = 2 of two equal logits is 1."""
    top = [0.0, 0.0] + [-5.0] * 8
    sample = Sample(TOK.encode("A"), [0.0], [0.0], [0.0], [top], "eos")
    assert phi_first(sample, TOK, k=2) == pytest.approx(1.0)
    assert phi_first(sample, TOK) == pytest.approx(normalized_entropy(top)) != pytest.approx(1.0)


def test_normalized_entropy_of_a_single_logit_is_zero():
    """One candidate is certainty: entropy 0 (log K = 0 would otherwise divide 0 by 0)."""
    assert normalized_entropy([3.0]) == 0.0
    assert normalized_entropy([]) == 0.0


@pytest.mark.parametrize("method", ["best-of-n", "step-beam"])
def test_a_judge_whose_question_would_pass_the_context_refuses_the_request_before_sampling(method, monkeypatch):
    """The judge reads prompt + answer + its own question: a request that fits the context but leaves
    no room for the question is refused before any candidate is drafted, naming the judge's question
    (a PromptTooLong, so a chat drops its oldest exchanges), never mid-search; one token less of
    answer than the limit runs."""
    from decodekit.engine import Engine
    from decodekit.errors import PromptTooLong
    from decodekit.search import batch

    model = LoadedModel(tiny_llama(seed=0, hidden_size=64, max_position=200), TOK, "tiny")
    question = max(len(Judge._follow_up(model, q)) for q in (Judge.ANSWER_QUESTION, Judge.STEP_QUESTION))
    prompt = "a" * 120
    room = 200 - len(TOK.encode(prompt)) - question
    real = batch.SearchContext.decode

    def watched(self, *args, **kwargs):
        watched.calls += 1
        return real(self, *args, **kwargs)

    watched.calls = 0
    monkeypatch.setattr(batch.SearchContext, "decode", watched)
    engine = Engine(model)
    with pytest.raises(PromptTooLong, match=f"\\+ {room + 1} new tokens \\+ the judge's question of {question} tokens"):
        engine.generate(prompt, method=method, n=2, seed=1, scorer="judge", max_new_tokens=room + 1, chat=False)
    assert watched.calls == 0
    engine.generate(prompt, method=method, n=2, seed=1, scorer="judge", max_new_tokens=room, chat=False)
    assert watched.calls > 0


def test_a_comma_before_more_than_three_digits_groups_nothing():
    """Commas sit only between groups of exactly three digits: "1,2345" holds no thousands' comma,
    so it reads as the numbers 1 and 2345 (the last one is 2345), never as 1,234 cut short."""
    cases = {"1,2345": "2345", "paid 12,3456 in all": "3456", "1,234,5678": "5678", "1,234": "1234"}
    assert {text: extract_number(text) for text in cases} == cases


def test_normalized_text_folds_compatibility_forms():
    """NFKD, not NFD: full-width letters and ligatures read as their plain letters."""
    assert normalize_text("\uff30\uff41\uff52\uff49\uff53") == normalize_text("Paris") == "paris"
    assert normalize_text("\ufb01nal answer") == "final answer"
    assert extract_line("\n\uff2c\uff49\uff4d\uff41!") == extract_line("Lima!") == "lima"


def test_an_answer_start_callable_returning_a_bool_is_refused():
    from decodekit.errors import InvalidParameter
    from decodekit.search.answers import answer_functions

    _, start = answer_functions("auto", lambda text: True)
    with pytest.raises(InvalidParameter, match="answer_start callable must return an offset"):
        start("abc")


def test_a_built_in_extractor_given_as_a_function_starts_its_answer_as_its_mode_does():
    """An eval task's answer extractor may be the built-in function itself (extract_number): its
    answer starts where that mode's does (the last number), not at 0 as a user callable's."""
    from decodekit.search.answers import answer_functions

    text = "so the total is 42."
    for fn, mode in ((extract_number, "number"), (extract_auto, "auto"), (extract_line, "line")):
        _, start = answer_functions(fn, None)
        assert start(text) == answer_start(text, mode)
    assert answer_functions(extract_number, None)[1](text) == text.index("42")
    assert answer_functions(lambda t: t, None)[1](text) == 0


def test_a_samples_phi_first_is_read_where_its_answer_starts():
    """sample_signals' phi_first is phi_first at the answer's start, not at the text's first content."""
    tokens = TOK.encode(" .Ab 7")
    flat, sharp = [0.0] * 10, [30.0] + [0.0] * 9
    sample = Sample(tokens, [0.0] * 6, [0.0] * 6, [0.0] * 6, [sharp, sharp, flat, flat, sharp, sharp], "eos")
    for start in (0, 3, 4):
        want = phi_first(sample, TOK, start_char=start)
        assert sample_signals(sample, TOK, start)["phi_first"] == pytest.approx(want)
    assert sample_signals(sample, TOK, 4)["phi_first"] != pytest.approx(sample_signals(sample, TOK, 0)["phi_first"])


def test_an_answer_that_is_only_an_eos_has_the_eos_choices_mean_logprob():
    """A row that chose EOS at once made one choice: its mean log-prob is that choice's; a row that
    made no choice has none. The per-token signals have no token to average over."""
    eos_only = Sample([], [], [], [], [], "eos", "", eos_logprob=-0.5)
    signals = sample_signals(eos_only, TOK)
    assert signals["mean_logprob"] == pytest.approx(eos_only.mean_logprob) == pytest.approx(-0.5)
    assert signals["self_certainty"] is None and signals["margin"] is None and signals["phi_first"] is None
    assert sample_signals(Sample.empty(), TOK)["mean_logprob"] is None


def test_sampled_agreement_draws_a_greedy_requests_samples_at_its_temperature():
    """sampled_agreement's n answers are samples at ``temperature`` even for a greedy request: answer
    i is the sequential sample seeded seed + i at that temperature."""
    from decodekit.engine import Engine, make_sampler
    from decodekit.engine.core import Request
    from decodekit.search.uncertainty import sampled_agreement

    model = LoadedModel(tiny_llama(seed=0), TOK, "tiny")
    req = Request(TOK.encode("hello"), make_sampler("greedy", {"seed": 7}), 12)
    found = sampled_agreement(model, req, None, lambda t: t, n=3, temperature=1.0)
    engine = Engine(model)
    want = [engine.generate("hello", method="sample", seed=7 + i, temperature=1.0, max_new_tokens=12, chat=False).text
            for i in range(3)]
    assert found["answers"] == want
    assert len(set(want)) > 1  # samples, not three copies of the greedy answer


def test_paraphrase_consistency_is_the_agreement_of_greedy_answers_to_each_paraphrase():
    """PC@k decodes each paraphrase greedily (even when the request samples), with or without the
    chat template as asked, and counts every paraphrase's tokens."""
    from decodekit.engine import Engine, make_sampler
    from decodekit.engine.core import Request
    from decodekit.search.uncertainty import paraphrase_consistency

    class Chat(CharTokenizer):
        def chat_prompt(self, messages):
            return "".join(f"<{m['role'][0]}>{m['content']}</{m['role'][0]}>" for m in messages) + "<a>"

    model = LoadedModel(tiny_llama(seed=0), Chat(96), "tiny")
    prompts = ["hello there", "a question", "Answer this: why?"]
    sampled = Request([], make_sampler("sample", {"seed": 3, "temperature": 1.5}), 10)
    engine = Engine(model)
    for chat in (False, True):
        gens = [engine.generate(p, method="greedy", max_new_tokens=10, chat=chat) for p in prompts]
        want = [g.text for g in gens]
        found = paraphrase_consistency(model, prompts, want[1], lambda t: t, sampled, chat=chat)
        assert found["answers"] == want
        assert found["pc"] == pytest.approx(want.count(want[1]) / len(want))
        assert found["tokens_spent"] == sum(len(g.tokens) + (g.finish_reason == "eos") for g in gens)
    plain = [engine.generate(p, method="greedy", max_new_tokens=10, chat=False).text for p in prompts]
    assert plain != want  # the template changes the answers, so the chat flag is seen


def test_a_judge_used_outside_a_search_still_refuses_a_request_with_no_room_for_its_question():
    """score() checks the judge's room itself: a scorer called directly (no search's check before it)
    refuses a request whose answer would push the judge's question past the context."""
    from decodekit.engine import make_sampler
    from decodekit.engine.core import Request
    from decodekit.errors import PromptTooLong
    from decodekit.search.batch import SearchContext

    model = LoadedModel(tiny_llama(seed=0, hidden_size=64, max_position=200), TOK, "tiny")
    question = max(len(Judge._follow_up(model, q)) for q in (Judge.ANSWER_QUESTION, Judge.STEP_QUESTION))
    prompt = TOK.encode("a" * 120)
    room = 200 - len(prompt) - question
    answer = Sample(TOK.encode("b"), [0.0], [0.0], [0.0], [[0.0]], "length")
    tight = SearchContext(model, Request(prompt, make_sampler("greedy", {}), room + 1))
    with pytest.raises(PromptTooLong, match="judge's question"):
        Judge().score(tight, [], answer)
    with pytest.raises(PromptTooLong, match="judge's question"):
        Judge().score_step(tight, [], answer)
    fits = SearchContext(model, Request(prompt, make_sampler("greedy", {}), room))
    assert 0.0 <= Judge().score(fits, [], answer) <= 1.0


def test_only_scorers_that_cannot_go_negative_may_weigh_votes():
    """Weighted voting takes only scorers whose values are never negative: log-likelihoods are
    (a probability's log), so they are no vote weights."""
    from decodekit.search.scorers import NONNEGATIVE_SCORER_NAMES, make_scorer

    sample = Sample(TOK.encode("ab"), [-1.0, -3.0], [0.5, 1.5], [0.2, 0.4], [[0.0] * 4] * 2, "eos", eos_logprob=-2.0)
    for name in ("loglik", "mean-logprob", "prob", "self-certainty"):
        can_go_negative = make_scorer(name).score(None, [], sample) < 0
        assert (name in NONNEGATIVE_SCORER_NAMES) == (not can_go_negative), name
    assert "judge" in NONNEGATIVE_SCORER_NAMES


def test_the_judge_counts_a_token_once_however_many_spellings_it_is():
    """p(yes) sums the probabilities of the distinct tokens spelling yes: a tokenizer that reads
    " yes" as the "yes" token does not count that token twice (while " no" is a token of its own)."""

    class Spaced(Tokenizer):
        WORDS = ["<eos>", "yes", "Yes", "no", "No", " no", " No", "maybe", "Q"]

        def __init__(self):
            self.eos_token_ids = frozenset({0})

        def encode(self, text):
            word = text if text in self.WORDS else text.strip()
            return [self.WORDS.index(word)] if word in self.WORDS else []

        def decode(self, ids):
            return "".join(self.WORDS[i] for i in ids if i)

    tok = Spaced()
    model = LoadedModel(tiny_llama(seed=0, vocab_size=len(Spaced.WORDS)), tok, "spaced")
    logits = torch.tensor([0.0, 1.0, 0.5, 0.2, -1.0, 0.7, -0.3, 3.0, 0.0])
    p = torch.softmax(logits, -1)
    yes_ids = {tok.encode(w)[0] for w in ("yes", "Yes", " yes", " Yes")}
    no_ids = {tok.encode(w)[0] for w in ("no", "No", " no", " No")}
    assert len(yes_ids) == 2 and len(no_ids) == 4
    yes, no = float(sum(p[i] for i in yes_ids)), float(sum(p[i] for i in no_ids))
    assert Judge.yes_share(model, logits) == pytest.approx(yes / (yes + no), abs=1e-6)


class _ByteTokenizer(Tokenizer):
    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", "replace")


def test_token_text_of_every_byte_of_a_four_byte_letter_is_the_letter():
    from decodekit.search.uncertainty import token_text

    """Each byte token of a 4-byte letter (CJK Ext. B, math bold A) writes that letter, the last
    byte included: its three earlier bytes lie in the CHARACTER_BYTES - 1 tokens before it."""
    tok = _ByteTokenizer()
    for text in ["\U00020000", "a\U0001d400b"]:
        tokens = tok.encode(text)
        start = 1 if text[0] == "a" else 0
        assert [token_text(tokens, i, tok) for i in range(start, start + 4)] == [text[start]] * 4


def test_token_ends_never_decrease_even_when_a_prefix_decodes_longer():
    """token_ends is documented non-decreasing: a tokenizer that spells a partial character as
    escapes ("\\xe4") decodes a prefix longer than the next one, and the end must not fall back."""
    from decodekit.search.uncertainty import token_ends

    class EscapingByteTokenizer(_ByteTokenizer):
        def decode(self, ids):
            return bytes(ids).decode("utf-8", "backslashreplace")

    tok = EscapingByteTokenizer()
    ends = token_ends(tok.encode("a\u4e1c"), tok)
    assert ends == sorted(ends) and ends[-1] >= len("a\u4e1c")


def test_paraphrase_consistency_keeps_the_requests_stop_strings():
    """Each paraphrase's greedy answer is cut at the request's stop strings, as the answer was:
    "4;9" stopped at ";" answers 4, not 9."""
    from tests.test_search import TOK, bigram_model
    from decodekit.engine import make_sampler
    from decodekit.engine.core import Request
    from decodekit.search.answers import extract_number
    from decodekit.search.uncertainty import paraphrase_consistency

    model = bigram_model({"p": {"4": 0.0}, "4": {";": 0.0}, ";": {"9": 0.0}, "9": {"": 0.0}})
    req = Request(TOK.encode("p"), make_sampler("greedy", {}), 10, stop=(";",))
    out = paraphrase_consistency(model, ["xp", "yp"], "4", extract_number, req, chat=False)
    assert out["answers"] == ["4", "4"] and out["pc"] == 1.0


def test_text_mode_of_a_text_with_nothing_but_punctuation_is_no_answer():
    """``text`` mode: a text that normalises to nothing (blank, or punctuation alone) is no answer
    (None), not an empty string that would vote."""
    text = extractor("text")
    assert text("  ?!...\n\t") is None
    assert text("") is None
    assert text("Paris!") == "paris"
