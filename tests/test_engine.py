"""The decode loop and the Python API on a tiny model."""

from __future__ import annotations

import pytest
import torch

from decodekit.engine import Engine, make_sampler, validate_options
from decodekit.errors import InvalidParameter, PromptTooLong, UnknownMethod
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tiny import tiny_llama
from decodekit.speculative.trained.networks import NETWORKS


def manual_greedy(backend, prompt_ids: list[int], n: int, eos: set[int]) -> list[int]:
    backend.reset()
    logits = backend.append(torch.tensor([prompt_ids])).logits[0, -1]
    out: list[int] = []
    for _ in range(n):
        token = int(logits.argmax())
        if token in eos:
            break
        out.append(token)
        logits = backend.append(torch.tensor([[token]])).logits[0, -1]
    return out


def test_greedy_equals_a_hand_written_argmax_loop(tiny_model):
    engine = Engine(tiny_model)
    for prompt in ("hello world", "abcabcabc", "The quick brown fox"):
        got = engine.generate(prompt, max_new_tokens=40, chat=False)
        ids = tiny_model.tokenizer.encode(prompt)
        assert got.tokens == manual_greedy(tiny_model.backend, ids, 40, {0})
        assert got.text == tiny_model.tokenizer.decode(got.tokens)


def test_stats_count_tokens_and_passes(tiny_model):
    g = Engine(tiny_model).generate("hello", max_new_tokens=12, chat=False)
    assert g.finish_reason in ("length", "eos")
    assert g.stats.new_tokens == len(g.tokens)
    # the last chosen token is never run through the model
    assert g.stats.forward_passes == max(len(g.tokens) - 1, 0) + (g.finish_reason == "eos")
    assert g.stats.decode_s > 0 and g.stats.tokens_per_s > 0
    assert set(g.as_dict()["stats"]) >= {"prefill_s", "decode_s", "new_tokens", "forward_passes", "tokens_per_s"}


def test_seeded_sampling_is_reproducible(tiny_model):
    engine = Engine(tiny_model)
    a = engine.generate("hi", method="sample", seed=7, max_new_tokens=30, chat=False)
    b = engine.generate("hi", method="sample", seed=7, max_new_tokens=30, chat=False)
    c = engine.generate("hi", method="sample", seed=8, max_new_tokens=30, chat=False)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_stop_string_cuts_text_and_tokens(tiny_model):
    engine = Engine(tiny_model)
    full = engine.generate("hello", max_new_tokens=40, chat=False)
    assert len(full.text) > 6
    stop = full.text[3:5]
    cut = engine.generate("hello", max_new_tokens=40, chat=False, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.tokens == full.tokens[: len(cut.tokens)]


def test_eos_ends_generation():
    tokenizer = CharTokenizer(96)
    model = LoadedModel(tiny_llama(seed=0), tokenizer, "tiny")
    free = Engine(model).generate("hello", max_new_tokens=20, chat=False)
    tokenizer.eos_token_ids = frozenset({free.tokens[4]})  # make the 5th token an end-of-sequence
    ended = Engine(model).generate("hello", max_new_tokens=20, chat=False)
    assert ended.finish_reason == "eos"
    assert ended.tokens == free.tokens[: free.tokens.index(free.tokens[4])]


def test_streamed_deltas_join_to_the_text(tiny_model):
    deltas: list[str] = []
    g = Engine(tiny_model).generate("stream me", max_new_tokens=25, chat=False, on_text=deltas.append)
    assert len(deltas) > 1
    assert "".join(deltas) == g.text


def test_should_stop_is_asked_before_the_request_and_between_the_passes_of_a_long_prompt():
    """A client gone while its request waited, or while its long prompt is read, frees the slot
    there: no pass at all, or none after the chunk being read (the int8 cache reads a prompt 64
    tokens a pass)."""
    from decodekit.models import CharTokenizer
    from decodekit.models.tiny import tiny_llama

    backend = tiny_llama(seed=0, hidden_size=64, max_position=1024).with_kv_cache("int8")
    engine, prompt = Engine(LoadedModel(backend, CharTokenizer(96), "tiny")), "the cat sat on the mat. " * 12
    gone = engine.generate(prompt, max_new_tokens=5, chat=False, should_stop=lambda: True)
    assert (gone.finish_reason, gone.text, gone.tokens, backend.length) == ("cancelled", "", [], 0)
    asked: list[int] = []
    left = engine.generate(prompt, max_new_tokens=5, chat=False, should_stop=lambda: asked.append(1) or len(asked) >= 3)
    assert (left.finish_reason, left.tokens, backend.length) == ("cancelled", [], 64)  # asked before it, and before its 1st and 2nd passes
    assert engine.generate(prompt, max_new_tokens=5, chat=False).tokens == Engine(
        LoadedModel(backend.clone(), CharTokenizer(96), "tiny")).generate(prompt, max_new_tokens=5, chat=False).tokens


def test_loading_choices_beside_a_loaded_model_are_refused_not_ignored(tiny_model):
    for choice in ({"kv_cache": "int8"}, {"numerics": "fast"}, {"dtype": "bfloat16"}, {"backend": "hf"}):
        with pytest.raises(InvalidParameter, match=next(iter(choice))):
            Engine(tiny_model, **choice)
    assert Engine(tiny_model).model is tiny_model


def test_the_one_call_generate_takes_a_loaded_model_too(tiny_model):
    import decodekit

    got = decodekit.generate("hello", model=tiny_model, max_new_tokens=6, chat=False)
    assert got.tokens == Engine(tiny_model).generate("hello", max_new_tokens=6, chat=False).tokens
    with pytest.raises(InvalidParameter, match="kv_cache"):
        decodekit.generate("hello", model=tiny_model, kv_cache="int8", max_new_tokens=6, chat=False)


def test_the_one_call_generate_loads_a_model_once_however_its_choices_are_spelt(monkeypatch):
    """The default model named or not, a default choice given or not, a cache spelling with a space:
    one engine (each spelling loaded the model again, and kept it)."""
    from decodekit.engine import api
    from decodekit.models import DEFAULT_MODEL

    built = []

    class Counted:
        def __init__(self, model, **loading):
            built.append((model, loading))

        def generate(self, prompt, **kwargs):
            return prompt

    monkeypatch.setattr(api, "Engine", Counted)
    monkeypatch.setattr(api, "_default_engines", {})
    for kw in ({}, {"model": DEFAULT_MODEL}, {"kv_cache": " full"}, {"dtype": "float32", "backend": "auto"},
               {"dtype": torch.float32}):
        assert api.generate("hi", **kw) == "hi"
    assert len(built) == 1
    api.generate("hi", kv_cache="int8")
    assert len(built) == 2


def test_a_generation_as_a_dict_carries_its_methods_figures(tiny_model):
    """``as_dict`` (the CLI's --json record) holds the text, tokens and stats, and a method's own
    figures beside them (a search's candidates and uncertainty signals)."""
    g = Engine(tiny_model).generate("hello", method="best-of-n", n=2, max_new_tokens=6, chat=False, seed=1)
    record = g.as_dict()
    assert (record["text"], record["tokens"], record["finish_reason"]) == (g.text, g.tokens, g.finish_reason)
    assert record["stats"] == g.stats.as_dict() and record["stats"]["new_tokens"] == len(g.tokens)
    assert g.extra and all(record[key] == value for key, value in g.extra.items())


def test_a_stream_never_hands_over_an_empty_delta(tiny_model):
    """``on_text`` is called only with new text: neither a step whose new text is all held back (a
    stop string may start there) nor the final update, once everything was streamed, sends ``""``."""
    engine = Engine(tiny_model)
    free = engine.generate("stream me", max_new_tokens=30, chat=False).text
    for stop in ((), [free[3:6] + "\x00"]):
        deltas: list[str] = []
        g = engine.generate("stream me", max_new_tokens=30, chat=False, stop=stop, on_text=deltas.append)
        assert "".join(deltas) == g.text and deltas, stop
        assert all(deltas), (stop, deltas)


def test_streams_hold_back_the_longest_start_of_any_stop_string(tiny_model):
    """With several stop strings a stream holds back the longest end of the text that any of them
    starts with, in either order (it held back each in turn, the later ones within what was left,
    and streamed text a stop string then removed)."""
    engine = Engine(tiny_model)
    free = engine.generate("stream me", max_new_tokens=30, chat=False).text
    for stops in ([free[1:2] + "\x00", free[:4]], [free[5:7] + "\x00", free[3:9], free[:2] + "\x00"]):
        for order in (stops, stops[::-1]):
            deltas: list[str] = []
            g = engine.generate("stream me", max_new_tokens=30, chat=False, stop=order, on_text=deltas.append)
            assert "".join(deltas) == g.text, order


NEEDS_FILES = set(NETWORKS)  # trained drafters: none exists for the tiny model (their loop is StepDecoder's)


def test_every_method_streams_text_that_joins_to_its_answer(tiny_model):
    """A search settles its answer at the end: a stream gets that text then, once, never nothing."""
    from decodekit.engine import available_methods

    engine, options = Engine(tiny_model), {"draft": {"draft_model": "self-truncated:1"}}
    for name in sorted(set(available_methods()) - NEEDS_FILES):
        deltas: list[str] = []
        # (seeded: unseeded, a sampling method's first token was EOS now and then, an empty answer)
        g = engine.generate("stream me", method=name, max_new_tokens=12, chat=False, on_text=deltas.append, seed=1,
                            **options.get(name, {}))
        assert g.text and "".join(deltas) == g.text, name


class CountingTokenizer:
    """Decodes like the wrapped tokenizer and counts the tokens it is asked to decode."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.inner.decode(ids)


@pytest.mark.parametrize("real", [False, True], ids=["chars", "smollm2"])
def test_a_long_stream_decodes_a_bounded_tail_per_step_and_joins_to_the_text(real, request):
    from decodekit.engine.core import TextStreamer

    if real:
        tokenizer = request.getfixturevalue("real_model").tokenizer
        ids = tokenizer.encode("Héllo wörld! 你好，世界。 🎉 tabs\tand  spaces.\n" * 60)
    else:
        from decodekit.models import CharTokenizer

        tokenizer = CharTokenizer(96)
        ids = [1 + (i * 7) % 95 for i in range(1500)]
    counting, pieces = CountingTokenizer(tokenizer), []
    streamer = TextStreamer(counting, ["STOP"], pieces.append)
    for n in range(1, len(ids) + 1):
        streamer.update(ids[:n])
    final = tokenizer.decode(ids)
    streamer.update(ids, final_text=final)
    assert "".join(pieces) == final
    assert counting.decoded < 400 * len(ids) < len(ids) ** 2 / 2  # a bounded tail a step, not the whole text


def test_bad_input_raises_clear_errors(tiny_model):
    engine = Engine(tiny_model)
    with pytest.raises(UnknownMethod, match="unknown method"):
        engine.generate("x", method="nonsense")
    with pytest.raises(InvalidParameter, match="top_p"):
        engine.generate("x", method="sample", top_p=0)
    with pytest.raises(InvalidParameter, match="takes no options"):
        engine.generate("x", not_an_option=3)
    with pytest.raises(InvalidParameter, match="max_new_tokens"):
        engine.generate("x", max_new_tokens=0)
    with pytest.raises(PromptTooLong):
        engine.generate("x" * 600, max_new_tokens=10, chat=False)
    with pytest.raises(InvalidParameter, match="ignore_eos is for plain and speculative decoding") as err:
        engine.generate("x", method="best-of-n", ignore_eos=True)  # a search's candidates end where the model ends them
    assert err.value.param == "ignore_eos"


@pytest.mark.parametrize("method", ["greedy", "pld", "sample"])
def test_a_generation_started_from_inside_another_on_the_same_model_is_refused(tiny_model, method):
    """The request lock lets its own thread in again: a generate() from an on_text callback would
    run on the cache the outer one is decoding into. It is refused; the model serves on afterwards."""
    engine = Engine(tiny_model)
    kw = dict(method=method, max_new_tokens=16, chat=False, **({"seed": 1, "temperature": 0.8} if method != "greedy" else {}))
    alone = engine.generate("abcabcabc", **kw)
    inner = []

    def nested(_: str) -> None:
        if not inner:
            inner.append(1)
            engine.generate("hi", max_new_tokens=2, chat=False)

    with pytest.raises(InvalidParameter, match="still running"):
        engine.generate("abcabcabc", on_text=nested, **kw)
    assert engine.generate("abcabcabc", **kw).tokens == alone.tokens
    # a search streams its answer once it is done, outside the lock: a generate() there is fine
    got = engine.generate("abcabcabc", method="beam", n=2, max_new_tokens=8, chat=False,
                          on_text=lambda _: inner.append(engine.generate("hi", max_new_tokens=2, chat=False)))
    assert got.text and len(inner) == 2


def test_sampler_parameters_reach_the_sampler(tiny_model):
    engine = Engine(tiny_model)
    # top_k=1 sampling is greedy whatever the seed
    greedy = engine.generate("abc", max_new_tokens=15, chat=False)
    topk1 = engine.generate("abc", method="sample", top_k=1, seed=3, max_new_tokens=15, chat=False)
    assert topk1.tokens == greedy.tokens


#: A value for every sampler parameter, chosen to change the tokens on the tiny model.
SAMPLER_VALUES = {
    "temperature": 0.5, "top_k": 3, "top_p": 0.5, "min_p": 0.3, "typical_p": 0.4, "epsilon": 0.03, "eta": 0.1,
    "top_n_sigma": 0.5, "top_h": 0.4, "adaptive_k": 2.0, "repetition_penalty": 3.0, "frequency_penalty": 3.0,
    "presence_penalty": 3.0, "no_repeat_ngram_size": 1, "greedy": True,
}


@pytest.mark.parametrize("name", sorted(SAMPLER_VALUES))
def test_every_sampler_parameter_reaches_the_sampler(tiny_model, name):
    """The engine's tokens with one parameter set equal a hand-made ``Sampler.from_params`` with the
    same parameter and seed; and that parameter changes the tokens, so a dropped one would show."""
    from decodekit.engine.core import PlainDecoding, Request, StepDecoder
    from decodekit.samplers import Sampler

    from decodekit.samplers.params import SAMPLER_OPTIONS

    assert set(SAMPLER_VALUES) | {"seed", "penalty_window"} == set(SAMPLER_OPTIONS)  # every one is here
    engine, prompt, seed = Engine(tiny_model), "abcabcabc the cat", 11
    ids = engine.model.prompt_ids(prompt, chat=False)

    def by_hand(**params) -> list[int]:
        sampler = Sampler.from_params(seed=seed, **params)
        return StepDecoder(PlainDecoding()).generate(tiny_model, Request(list(ids), sampler, 30)).tokens

    got = engine.generate(prompt, method="sample", seed=seed, max_new_tokens=30, chat=False, **{name: SAMPLER_VALUES[name]})
    assert got.tokens == by_hand(**{name: SAMPLER_VALUES[name]})
    assert got.tokens != by_hand()


def test_the_penalty_window_reaches_the_sampler(tiny_model):
    from decodekit.engine.core import PlainDecoding, Request, StepDecoder
    from decodekit.samplers import Sampler

    engine = Engine(tiny_model)
    ids = engine.model.prompt_ids("abababab", chat=False)
    params = {"frequency_penalty": 3.0, "seed": 2}

    def by_hand(**extra) -> list[int]:
        return StepDecoder(PlainDecoding()).generate(
            tiny_model, Request(list(ids), Sampler.from_params(**params, **extra), 30)).tokens

    got = engine.generate("abababab", method="sample", max_new_tokens=30, chat=False, penalty_window=2, **params)
    assert got.tokens == by_hand(penalty_window=2) != by_hand()


@pytest.mark.parametrize("method", ["greedy", "pld", "best-of-n"])
def test_a_model_whose_weights_hold_a_nan_is_refused_not_decoded(method):
    """A damaged weight (a NaN in the final norm here) makes every logit NaN: the request fails
    in one line instead of decoding token 0 over and over (GGUF files carry no checksums)."""
    from decodekit.errors import InvalidModel

    backend = tiny_llama(seed=0)
    backend.weights.final_norm[3] = float("nan")
    engine = Engine(LoadedModel(backend, CharTokenizer(96), "tiny"))
    with pytest.raises(InvalidModel, match="logits are not finite"):
        engine.generate("hello", method=method, max_new_tokens=4, chat=False)


def kept_and_fresh_engines():
    """An engine whose backend keeps its cache between requests (row-independent kernels), and a
    fresh one over a clone: what a next turn must answer alike."""
    backend = tiny_llama(seed=0, hidden_size=64, gguf_blocks=True)
    engine = Engine(LoadedModel(backend, CharTokenizer(96), "tiny"))
    return backend, engine, Engine(LoadedModel(backend.clone(), CharTokenizer(96), "tiny"))


@pytest.mark.parametrize("method, options", [("greedy", {}), ("sample", {"seed": 3, "temperature": 0.9}),
                                             ("pld", {"budget": 8})])
def test_a_chats_next_turn_reads_only_its_new_part_and_answers_as_a_fresh_engine(method, options):
    """After plain or speculative decoding the engine notes what its cache holds, so a next prompt
    that extends prompt and answer reads only its rest (the row-independent kernels give the same
    bits); after a search or a cancelled request, nothing is kept."""
    backend, engine, fresh = kept_and_fresh_engines()
    tok = engine.model.tokenizer
    prompt = tok.encode("hello world hello")
    first = engine.generate(prompt, chat=False, method=method, max_new_tokens=12, **options)
    follow = prompt + first.tokens + tok.encode(" and again")
    assert backend.shared_prefix(follow) == backend.length >= len(prompt) + len(first.tokens) - 1  # (the last one: not read)
    again = engine.generate(follow, chat=False, method=method, max_new_tokens=12, **options)
    assert again.tokens == fresh.generate(follow, chat=False, method=method, max_new_tokens=12, **options).tokens
    other = tok.encode("zzz quite another prompt")
    engine.generate(other, chat=False, method=method, max_new_tokens=4, should_stop=lambda: True, **options)
    assert engine.generate(other, chat=False, method=method, max_new_tokens=8, **options).tokens == \
        fresh.generate(other, chat=False, method=method, max_new_tokens=8, **options).tokens
    engine.generate(follow, chat=False, method="best-of-n", n=2, max_new_tokens=4)
    assert backend.kept_ids is None


class Burst:
    """A step method that commits a fixed run of tokens every step (as a speculative step accepting many)."""

    def __init__(self, tokens: list[int]):
        from decodekit.engine.core import StepMethod

        class _Burst(StepMethod):
            def step(_, state):
                state.commit(tokens)
                return list(tokens)

        self.method = _Burst()


def test_a_step_that_runs_past_max_new_tokens_returns_max_new_tokens(tiny_model):
    """max_new_tokens bounds the output, however many tokens one step accepted."""
    from decodekit.engine.core import Request, StepDecoder
    from decodekit.samplers import Sampler

    burst = tiny_model.tokenizer.encode("abcdefghij")
    request = Request(tiny_model.tokenizer.encode("hi"), Sampler.from_params(), max_new_tokens=7)
    got = StepDecoder(Burst(burst).method).generate(tiny_model, request)
    assert (got.tokens, got.text, got.finish_reason, got.stats.new_tokens) == (burst[:7], "abcdefg", "length", 7)


def scripted_steps(groups: list[list[int]]):
    """A step method that commits the given groups of tokens, one group a step (a speculative step accepts several)."""
    from decodekit.engine.core import StepMethod

    left = [list(g) for g in groups]

    class Scripted(StepMethod):
        def step(self, state):
            group = left.pop(0)
            state.commit(group)
            return group

    return Scripted()


def test_tokens_a_step_produced_after_an_end_of_sequence_token_are_not_output(tiny_model):
    """A step's tokens end at the first end-of-sequence token among them: what a step accepted past
    it is neither text nor token of the answer, and the request ends there ("eos")."""
    from decodekit.engine.core import Request, StepDecoder
    from decodekit.samplers import Sampler

    tok = tiny_model.tokenizer
    burst = tok.encode("abc") + [0] + tok.encode("def")
    request = Request(tok.encode("hi"), Sampler.from_params(), max_new_tokens=20)
    got = StepDecoder(scripted_steps([burst, tok.encode("ghi")])).generate(tiny_model, request)
    assert (got.tokens, got.text, got.finish_reason, got.cut_off) == (tok.encode("abc"), "abc", "eos", [])


def test_a_stop_completed_in_the_step_that_ends_at_an_end_of_sequence_token_finishes_on_the_stop(tiny_model):
    """A stop string completed in a step that also ends at an end-of-sequence token cuts the text
    there and is the finish reason, as when the same tokens come one a step (the stop is found first)."""
    from decodekit.engine.core import Request, StepDecoder
    from decodekit.samplers import Sampler

    tok = tiny_model.tokenizer
    tokens = tok.encode("abcd") + [0]
    results = []
    for groups in ([tokens], [[t] for t in tokens]):
        request = Request(tok.encode("hi"), Sampler.from_params(), max_new_tokens=20, stop="bc")
        got = StepDecoder(scripted_steps(groups)).generate(tiny_model, request)
        results.append((got.tokens, got.text, got.finish_reason, got.cut_off))
    assert results[0] == results[1] == (tok.encode("a"), "a", "stop", tok.encode("bc"))


def test_a_stream_hands_over_at_the_end_what_it_held_back_for_a_stop_string_that_never_came(tiny_model):
    """A stream holds back text a stop string may still claim; when the output ends without it
    (max_new_tokens), the last update hands that text over, so the deltas join to the whole answer."""
    engine = Engine(tiny_model)
    free = engine.generate("stream me", max_new_tokens=30, chat=False, ignore_eos=True).text
    deltas: list[str] = []
    g = engine.generate("stream me", max_new_tokens=30, chat=False, ignore_eos=True, stop=free[-3:] + "\x00",
                        on_text=deltas.append)
    assert (g.text, g.finish_reason) == (free, "length")
    assert "".join(deltas) == free and deltas[-1].endswith(free[-3:])


def test_a_request_cancelled_before_it_decoded_reports_zero_tokens_per_second(tiny_model):
    """A request that ran no decode time (cancelled before its first step) has 0 tokens/s in its
    figures, not a division by zero."""
    g = Engine(tiny_model).generate("hello", max_new_tokens=5, chat=False, should_stop=lambda: True)
    assert g.finish_reason == "cancelled" and g.stats.decode_s == 0
    assert g.stats.tokens_per_s == 0.0 and g.as_dict()["stats"]["tokens_per_s"] == 0.0


def test_a_request_decoded_twice_keeps_its_prompt_and_answers_the_same(tiny_model):
    """The decode state extends a copy of the prompt: the request's prompt_ids stay as given, so a
    request run again (a retry) reads the same prompt and gives the same answer."""
    from decodekit.engine.core import PlainDecoding, Request, StepDecoder
    from decodekit.samplers import Sampler

    prompt = tiny_model.tokenizer.encode("hello")
    request = Request(list(prompt), Sampler.from_params(), max_new_tokens=8, ignore_eos=True)
    first = StepDecoder(PlainDecoding()).generate(tiny_model, request)
    assert request.prompt_ids == prompt and len(first.tokens) == 8
    assert StepDecoder(PlainDecoding()).generate(tiny_model, request).tokens == first.tokens


def test_tokens_left_counts_only_the_new_tokens():
    """DecodeState.tokens_left: what max_new_tokens still allows, the prompt not counted."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.samplers import Sampler

    backend = tiny_llama(seed=0)
    state = DecodeState(backend, Sampler.from_params(), [5, 6, 7, 8, 9], GenerationStats())
    assert state.tokens_left is None
    state.max_new_tokens = 10
    assert state.tokens_left == 10
    state.commit([11, 12, 13])
    assert state.tokens_left == 7


def test_a_stop_string_counts_the_kept_tokens_and_bills_those_up_to_the_stop(tiny_model):
    """new_tokens counts the tokens handed back; the tokens a stop cut off are those generated
    after them up to the one that completes the stop (one character a token here), and no more."""
    engine = Engine(tiny_model)
    full = engine.generate("hello", max_new_tokens=40, chat=False)
    stop = full.text[6:8]
    cut = engine.generate("hello", max_new_tokens=40, chat=False, stop=stop)
    start = full.text.index(stop)
    assert cut.finish_reason == "stop" and cut.tokens == full.tokens[:start]
    assert cut.stats.new_tokens == len(cut.tokens) == start
    assert cut.cut_off == full.tokens[start : start + len(stop)]
    assert cut.generated == start + len(stop)


def test_prefill_time_is_the_prompts_pass_and_decode_time_the_rest(tiny_model, monkeypatch):
    """prefill_s is the prompt's pass alone, decode_s the steps after it (a clock that moves 100
    in a prefill and 1 in a step, so each is known by hand)."""
    import types

    from decodekit.engine import core

    now = [0.0]
    monkeypatch.setattr(core, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    backend = tiny_model.backend
    prefill, step = backend.prefill, backend.step
    monkeypatch.setattr(backend, "prefill", lambda *a, **k: now.__setitem__(0, now[0] + 100) or prefill(*a, **k))
    monkeypatch.setattr(backend, "step", lambda *a, **k: now.__setitem__(0, now[0] + 1) or step(*a, **k))
    g = Engine(tiny_model).generate("hello", max_new_tokens=9, chat=False, ignore_eos=True)
    assert g.stats.forward_passes == 8  # the last token chosen is never run
    assert (g.stats.prefill_s, g.stats.decode_s) == (100, 8)
    assert g.stats.tokens_per_s == 9 / 8


def test_a_request_that_fills_the_context_exactly_fits(tiny_model):
    """A prompt plus max_new_tokens up to the model's context is allowed; one more is refused."""
    limit = tiny_model.backend.info.max_length
    prompt = [1 + i % 90 for i in range(limit - 6)]
    got = Engine(tiny_model).generate(prompt, max_new_tokens=6, chat=False, ignore_eos=True)
    assert len(got.tokens) == 6
    with pytest.raises(PromptTooLong):
        Engine(tiny_model).generate(prompt, max_new_tokens=7, chat=False, ignore_eos=True)


@pytest.mark.parametrize("method, options", [("beam", {"n": 1}), ("best-of-n", {"n": 2, "scorer": "judge"})])
def test_a_search_that_ends_on_one_row_keeps_nothing_and_a_next_turn_answers_as_a_fresh_engine(method, options):
    """After a search the cache holds what it read last (a candidate, a judge's question), not
    prompt and answer: nothing is kept, even where it ends on one row."""
    backend, engine, fresh = kept_and_fresh_engines()
    tok = engine.model.tokenizer
    prompt = tok.encode("hello world hello")
    first = engine.generate(prompt, chat=False, method=method, max_new_tokens=8, **options)
    assert backend.batch_size == 1 and backend.kept_ids is None
    follow = prompt + first.tokens + tok.encode(" and again")
    assert engine.generate(follow, chat=False, max_new_tokens=8).tokens == \
        fresh.generate(follow, chat=False, max_new_tokens=8).tokens


def test_a_search_with_no_answer_streams_nothing(tiny_model):
    """A search hands its answer's text over once, at the end; with no text (cancelled) nothing,
    not an empty delta."""
    pieces: list[str] = []
    got = Engine(tiny_model).generate("hi", method="best-of-n", n=2, max_new_tokens=4, chat=False,
                                      should_stop=lambda: True, on_text=pieces.append)
    assert (got.finish_reason, pieces) == ("cancelled", [])


def test_should_stop_is_asked_after_every_step(tiny_model):
    """should_stop is asked after every step: once it says so (here, as soon as text was streamed),
    the generation ends there, cancelled, with what it has."""
    pieces: list[str] = []
    got = Engine(tiny_model).generate("hello", max_new_tokens=30, chat=False, ignore_eos=True, on_text=pieces.append,
                                      should_stop=lambda: bool(pieces))
    assert (got.finish_reason, len(got.tokens), "".join(pieces)) == ("cancelled", 1, got.text)


def test_a_prompt_that_encodes_to_no_tokens_is_refused(tiny_model):
    with pytest.raises(InvalidParameter, match="empty"):
        Engine(tiny_model).generate([{"role": "user", "content": ""}], chat=False, max_new_tokens=3)


def test_a_methods_own_option_named_like_a_loading_choice_reaches_it(tiny_model):
    """A plugin's method may have an option called kv_cache (or model, ...): it is the method's, not
    a loading choice refused per request."""
    from decodekit.engine.registry import _METHODS, plain_decoder, register_method
    from decodekit.options import OptionSpec

    seen = {}

    def build(kv_cache=None):
        seen["kv_cache"] = kv_cache
        return plain_decoder()

    register_method("test-kvopt", build, "test", lossless=True, family="plain",
                    options={"kv_cache": OptionSpec("kv_cache", str, None)}, sampling="never")
    try:
        Engine(tiny_model).generate("hi", method="test-kvopt", kv_cache="int8", max_new_tokens=2, chat=False)
        assert seen["kv_cache"] == "int8"
    finally:
        _METHODS.pop("test-kvopt", None)


class TemplatedChars(CharTokenizer):
    """A character tokenizer with a chat template, which records the chats it renders."""

    def __init__(self, size):
        super().__init__(size)
        self.chats = []

    def chat_prompt(self, messages):
        self.chats.append(messages)
        return "U:" + messages[-1]["content"] + "\nA:"


def test_generate_applies_the_chat_template_unless_told_not_to():
    tokenizer = TemplatedChars(96)
    engine = Engine(LoadedModel(backend=tiny_llama(seed=0), tokenizer=tokenizer, name="tiny"))
    default = engine.generate("hi", max_new_tokens=3)
    assert tokenizer.chats == [[{"role": "user", "content": "hi"}]]
    assert default.tokens == engine.generate("hi", max_new_tokens=3, chat=True).tokens
    tokenizer.chats.clear()
    engine.generate("hi", max_new_tokens=3, chat=False)
    assert tokenizer.chats == []


def test_max_new_tokens_defaults_to_256(tiny_model):
    g = Engine(tiny_model).generate("hello", chat=False, ignore_eos=True)
    assert len(g.tokens) == 256 and g.finish_reason == "length"


def test_validate_options_returns_the_options_given_parsed_and_no_defaults():
    from decodekit.engine import validate_options

    assert validate_options("pld", {"max_ngram": "3"}) == {"max_ngram": 3}
    assert validate_options("pld", {}) == {}


def test_a_tuple_of_token_ids_is_a_prompt_as_a_list_is(tiny_model):
    engine = Engine(tiny_model)
    ids = tiny_model.tokenizer.encode("hello")
    assert engine.generate(tuple(ids), max_new_tokens=5).tokens == engine.generate(list(ids), max_new_tokens=5).tokens


def test_a_refused_temperature_is_shown_short():
    from decodekit.engine import make_sampler

    with pytest.raises(InvalidParameter, match=r"temperature=0\.3 would be ignored"):
        make_sampler("greedy", {"temperature": 0.1 + 0.2})
