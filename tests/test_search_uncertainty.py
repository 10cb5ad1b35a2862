"""Uncertainty signals and the judge scorer on hand-made inputs."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tokenizer import Tokenizer
from decodekit.models.tiny import tiny_llama
from decodekit.search.answers import answer_start, extract_auto, extract_line, extract_number, normalize_text
from decodekit.search.batch import Sample
from decodekit.search.scorers import Judge
from decodekit.search.uncertainty import agreement, first_content_index, normalized_entropy, phi_first, sample_signals
from decodekit.samplers import Histories, Sampler, Temperature

TOK = CharTokenizer(96)


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
