"""``decodekit eval longctx`` on a tiny model: every policy at lengths inside and past the context
window, NLL relative to the full cache, memory, pass-key answers, the report and the plot."""

from __future__ import annotations

import json

import pytest
import torch

from decodekit.eval import cli as eval_cli
from decodekit.eval.longctx import FILLER, LongContextConfig, continuation_nll, document_tokens, evaluate_long_context, passkey_prompt
from decodekit.errors import InvalidParameter
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tiny import tiny_llama

POLICIES = ("full", "int8", "int4:group=8,residual=64", "sink:4,window:64,every:8", "h2o:budget=64,window=16", "snapkv:budget=64,window=8")


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return LoadedModel(tiny_llama(seed=0, hidden_size=64, max_position=512), CharTokenizer(96), "tiny")


def test_every_policy_at_every_length(model):
    config = LongContextConfig(policies=POLICIES, lengths=(120, 300, 600), depths=(0.5,), continuation=12, decode_tokens=4)
    rows = {(r["policy"], r["length"]): r for r in evaluate_long_context(model, config)["rows"]}
    assert rows[("full", 120)]["nll_change"] == 0 and rows[("full", 120)]["memory_saved"] == 0
    for (policy, length), row in rows.items():  # relative to the full cache at the same length: NLL / full NLL - 1
        if "nll" in row and "nll" in rows[("full", length)]:
            assert row["nll_change"] == pytest.approx(row["nll"] / rows[("full", length)]["nll"] - 1)
    assert abs(rows[("int8", 120)]["nll_change"]) < 0.05
    assert rows[("int8", 120)]["memory_saved"] == pytest.approx(1 - 20 / 64)  # head size 16: 16 bytes + a scale
    # the peak: StreamingLLM and H2O evict as they read the context; SnapKV holds all of it (and its
    # scores) before it compresses it (its memory at the end is a fraction of the full cache's)
    for policy in ("sink:4,window:64,every:8", "h2o:budget=64,window=16"):
        assert rows[(policy, 300)]["memory_saved"] > 0.5 and rows[(policy, 300)]["nll"] > 0
    assert rows[("snapkv:budget=64,window=8", 300)]["memory_saved"] < 0 < rows[("snapkv:budget=64,window=8", 300)]["nll"]
    # past the 512-token window only the streaming cache runs, in the memory it had at 120 tokens
    assert rows[("int4:group=8,residual=64", 120)]["nll_change"] != 0  # its codes are read from position 71 on
    for policy in ("full", "int8", "int4:group=8,residual=64", "h2o:budget=64,window=16", "snapkv:budget=64,window=8"):
        assert "context" in rows[(policy, 600)]["error"]
    streaming = rows[("sink:4,window:64,every:8", 600)]
    assert "error" not in streaming and streaming["cache_bytes"] <= rows[("sink:4,window:64,every:8", 120)]["cache_bytes"]
    assert all(isinstance(v, bool) for r in rows.values() if "passkey" in r for v in r["passkey"].values())


def test_continuation_nll_is_the_mean_nll_of_the_tokens_after_the_context(model):
    """Each continuation token is scored by the logits of everything before it (here all positions of
    one pass), and the mean is over the continuation's tokens alone."""
    ids = document_tokens(model.tokenizer, 40)
    assert len(ids) == 40
    backend = model.backend.clone()
    backend.reset()
    logits = backend.append(torch.tensor([ids])).logits[0].float()
    expected = -sum(float(torch.log_softmax(logits[k - 1], -1)[ids[k]]) for k in range(30, 40)) / 10
    assert continuation_nll(model.backend.clone(), ids, 30) == pytest.approx(expected, rel=1e-5)


def test_a_continuation_past_the_context_is_an_error_row_before_any_pass(model):
    config = LongContextConfig(policies=("full",), lengths=(120,), depths=(0.5,), continuation=400, decode_tokens=4)
    (row,) = evaluate_long_context(model, config)["rows"]
    assert row["error"] == "120 + 400 tokens after it exceed the context of 512 this cache holds"
    # nor a decode run past it after the continuation's figures (they were kept beside the error)
    config = LongContextConfig(policies=("full",), lengths=(500,), depths=(0.5,), continuation=8, decode_tokens=32)
    (row,) = evaluate_long_context(model, config)["rows"]
    assert set(row) == {"policy", "length", "error"}


def test_the_full_row_is_the_full_cache_whatever_cache_the_model_was_loaded_with(model):
    config = LongContextConfig(policies=("full", "sink:4,window:32"), lengths=(120,), depths=(0.5,), continuation=12,
                               decode_tokens=4)
    windowed = LoadedModel(model.backend.with_kv_cache("sink:4,window:32"), model.tokenizer, "tiny")

    def figures(m: LoadedModel) -> list[dict]:  # all but the timings
        return [{k: v for k, v in r.items() if k not in ("decode_tok_s", "prefill_s")}
                for r in evaluate_long_context(m, config)["rows"]]

    assert figures(windowed) == figures(model) and figures(model)[1]["nll_change"] != 0


def test_passkey_prompt_hides_the_key_at_the_depth():
    tok = CharTokenizer(128)
    for depth in (0.0, 0.5, 1.0):
        text = tok.decode(passkey_prompt(tok, 2000, depth, 12345))
        where = text.index("The pass key is 12345") / len(text)
        assert abs(where - depth) < 0.1 and text.endswith("The pass key is")


def test_passkey_prompts_are_as_long_as_labelled_within_a_filler_sentence(real_model):
    """Repeated, the filler tokenizes shorter than alone: prompts came out 5% short of their label."""
    from decodekit.eval.longctx import FILLER

    tok, sentence = real_model.tokenizer, len(real_model.tokenizer.encode(FILLER))
    for length in (2048, 8000):
        assert abs(len(passkey_prompt(tok, length, 0.5, 12345)) - length) <= sentence


def run_longctx(model, out, policies: str, depths: str) -> dict:
    """``decodekit eval longctx`` at 100 tokens on ``model``: its results.json."""
    parser = eval_cli.ArgumentParser()
    eval_cli.add_arguments(parser)
    args = parser.parse_args(["longctx", "--policies", policies, "--lengths", "100", "--depths", depths,
                              "--continuation", "8", "--out", str(out)])
    assert eval_cli.run(args, model=model) == 0
    return json.loads((out / "results.json").read_text())


def test_the_command_writes_report_json_and_plot(model, tmp_path, capsys):
    result = run_longctx(model, tmp_path, "full;sink:4,window:32", "0.5")
    assert [r["policy"] for r in result["rows"]] == ["full", "sink:4,window:32"]
    assert (tmp_path / "plot.png").stat().st_size > 0 and "| 100 | full |" in (tmp_path / "report.md").read_text()


def test_the_continuation_flag_sets_the_tokens_scored(model, tmp_path):
    """--continuation N: N tokens after the context are scored (the run helper gives 8; the default is 128)."""
    assert run_longctx(model, tmp_path, "full", "0.5")["config"]["continuation"] == 8


def test_the_ends_of_the_depth_range_are_depths_too(model, tmp_path):
    """--depths takes numbers in [0, 1], both ends included: 0 hides the key at the start, 1 at the end."""
    result = run_longctx(model, tmp_path, "full", "0,1")
    assert result["config"]["depths"] == [0.0, 1.0] and set(result["rows"][0]["passkey"]) == {"0.0", "1.0"}


@pytest.mark.parametrize("flags, message", [(["--policies", "bogus"], "kv cache"), (["--lengths", "x"], "--lengths"),
                                            (["--depths", "2"], "--depths"), (["--continuation", "0"], "--continuation"),
                                            (["--depths", "0.5,0.50"], "twice")])
def test_bad_flags_fail_in_one_line(model, flags, message):
    parser = eval_cli.ArgumentParser()
    eval_cli.add_arguments(parser)
    with pytest.raises(InvalidParameter, match=message):
        eval_cli.run(parser.parse_args(["longctx", *flags]), model=model)


def test_a_policy_the_model_does_not_take_is_its_rows_error_and_the_rest_run():
    """Gemma 3's sliding windows take no evicting or int4 cache: those rows say so, the others run."""
    from decodekit.models.tiny import tiny_gemma3

    gemma = LoadedModel(tiny_gemma3(seed=0), CharTokenizer(96), "tiny-gemma")
    config = LongContextConfig(policies=("full", "int4:group=8,residual=64", "int8"), lengths=(120,), depths=(0.5,),
                               continuation=12, decode_tokens=4)
    rows = {r["policy"]: r for r in evaluate_long_context(gemma, config)["rows"]}
    assert "not supported for Gemma 3" in rows["int4:group=8,residual=64"]["error"]
    assert "error" not in rows["full"] and "error" not in rows["int8"] and rows["int8"]["nll"] > 0


def test_a_row_is_an_error_when_the_decode_run_or_the_pass_key_answer_would_pass_the_context(model):
    """What a row reads past the context is the most of the continuation, the decode run and the
    pass-key answer: each is checked against the context before any pass."""
    from decodekit.eval.longctx import PASSKEY_ANSWER_TOKENS

    config = LongContextConfig(policies=("full",), lengths=(490,), depths=(0.5,), continuation=4, decode_tokens=30)
    (row,) = evaluate_long_context(model, config)["rows"]
    assert row["error"] == "490 + 30 tokens after it exceed the context of 512 this cache holds"
    length = 512 - PASSKEY_ANSWER_TOKENS + 1
    config = LongContextConfig(policies=("full",), lengths=(length,), depths=(0.5,), continuation=4, decode_tokens=4)
    (row,) = evaluate_long_context(model, config)["rows"]
    assert row["error"] == f"{length} + {PASSKEY_ANSWER_TOKENS} tokens after it exceed the context of 512 this cache holds"


def test_passkey_prompts_are_at_most_as_long_as_labelled_and_within_a_filler_sentence():
    """One character a token: the prompt is at most ``length`` tokens, and short of it by less than a filler."""
    from decodekit.eval.longctx import FILLER

    tok = CharTokenizer(128)
    for length in (300, 1000, 2000):
        for depth in (0.0, 0.5, 1.0):
            n = len(passkey_prompt(tok, length, depth, 12345))
            assert length - len(FILLER) < n <= length, (length, depth, n)


class _EchoEngine:
    """An engine whose answer is the last 80 characters of its prompt (there: the pass key hidden at
    depth 1, not the one at depth 0), and whose decode run is 4 tokens in 2 seconds."""

    def __init__(self, model):
        self.tokenizer = model.tokenizer

    def generate(self, prompt, max_new_tokens, ignore_eos=False):
        from types import SimpleNamespace

        stats = SimpleNamespace(new_tokens=4, decode_s=2.0, prefill_s=0.5)
        return SimpleNamespace(text=self.tokenizer.decode(prompt)[-80:], stats=stats)


def test_a_pass_key_is_found_where_the_answer_holds_it_and_speed_is_tokens_per_second(model, monkeypatch):
    """Pass-key retrieval is correct when the number appears in the answer; decode speed is the run's
    new tokens over its decode seconds."""
    monkeypatch.setattr("decodekit.engine.Engine", _EchoEngine)
    config = LongContextConfig(policies=("full",), lengths=(300,), depths=(0.0, 1.0), continuation=4, decode_tokens=4)
    (row,) = evaluate_long_context(model, config)["rows"]
    assert row["passkey"] == {"0.0": False, "1.0": True}
    assert row["decode_tok_s"] == pytest.approx(2.0) and row["prefill_s"] == 0.5


def test_a_value_error_in_a_run_is_its_rows_error(model, monkeypatch):
    """A run that fails (e.g. past a window) is reported as the row's error, and no figure of it is kept."""

    class Failing(_EchoEngine):
        def generate(self, prompt, max_new_tokens, ignore_eos=False):
            raise ValueError("position 600 is past the window")

    monkeypatch.setattr("decodekit.engine.Engine", Failing)
    config = LongContextConfig(policies=("full",), lengths=(120,), depths=(0.5,), continuation=4, decode_tokens=4)
    (row,) = evaluate_long_context(model, config)["rows"]
    assert row == {"policy": "full", "length": 120, "error": "position 600 is past the window"}


def test_longctx_on_a_backend_without_kv_cache_policies_is_one_line():
    """The policies are the native backend's: another backend is refused before any work."""
    from tests.test_speculative_sampling import trigram_model

    config = LongContextConfig(policies=("full",), lengths=(120,), depths=(0.5,), continuation=4, decode_tokens=4)
    with pytest.raises(InvalidParameter, match="needs the native backend"):
        evaluate_long_context(trigram_model(), config)


def test_the_document_repeats_the_texts_until_it_has_the_tokens_needed():
    """A tokenizer that reads the texts as few tokens still gets ``needed`` of them (the texts repeated)."""

    class Short:
        def encode(self, text):
            return [1, 2, 3]

    assert document_tokens(Short(), 10) == [1, 2, 3] * 3 + [1]


class _RecordingEngine(_EchoEngine):
    """An echo engine that records what each run was given."""

    calls: list = []

    def generate(self, prompt, max_new_tokens, ignore_eos=False):
        _RecordingEngine.calls.append((len(prompt), max_new_tokens, ignore_eos))
        return super().generate(prompt, max_new_tokens, ignore_eos)


def test_every_policy_at_a_length_is_asked_for_the_same_pass_keys_and_the_seed_draws_them(model, monkeypatch):
    """Policies are compared on the same prompts (the keys drawn per length, from the seed): another
    seed hides other keys."""
    import decodekit.eval.longctx as longctx

    monkeypatch.setattr("decodekit.engine.Engine", _EchoEngine)
    keys = []
    original = longctx.passkey_prompt
    monkeypatch.setattr(longctx, "passkey_prompt", lambda tok, length, depth, key: keys.append(key) or original(tok, length, depth, key))

    def drawn(seed):
        keys.clear()
        config = LongContextConfig(policies=("full", "int8"), lengths=(120,), depths=(0.0, 1.0), continuation=4,
                                   decode_tokens=4, seed=seed)
        evaluate_long_context(model, config)
        return list(keys)

    zero = drawn(0)
    assert zero[:2] == zero[2:] and zero == drawn(0)
    assert drawn(1) != zero


def test_decode_speed_is_timed_over_the_context_alone_for_the_tokens_asked_ignoring_eos(model, monkeypatch):
    """The decode run reads the ``length`` context tokens and generates ``decode_tokens`` whatever the
    model says (an early EOS would time fewer); the pass-key answers are short greedy runs."""
    from decodekit.eval.longctx import PASSKEY_ANSWER_TOKENS

    monkeypatch.setattr("decodekit.engine.Engine", _RecordingEngine)
    _RecordingEngine.calls = []
    config = LongContextConfig(policies=("full",), lengths=(120,), depths=(0.5,), continuation=4, decode_tokens=6)
    evaluate_long_context(model, config)
    (decode, (_, answer_tokens, _)) = _RecordingEngine.calls
    assert decode == (120, 6, True) and answer_tokens == PASSKEY_ANSWER_TOKENS


def test_the_report_gives_the_nll_change_and_memory_saved_in_percent():
    """A row's NLL change +0.0125 reads +1.25%, its memory saved 0.75 reads 75%, its peak 2e6 bytes 2.0 MB."""
    from decodekit.eval.longctx import markdown

    row = {"length": 100, "policy": "int8", "nll": 2.0, "nll_change": 0.0125, "cache_bytes": 2_000_000,
           "memory_saved": 0.75, "decode_tok_s": 10.0, "passkey": {"0.5": True}}
    result = {"config": {"depths": [0.5], "continuation": 8, "decode_tokens": 4}, "rows": [row]}
    assert "| 100 | int8 | 2.0000 | +1.25% | 2.0 | 75% | 10.0 | yes |" in markdown(result)


def test_a_misspelt_policy_is_refused_before_any_row_runs(model):
    """A bad spelling is one error before any work, not an error row after the others have run."""
    config = LongContextConfig(policies=("full", "lru"), lengths=(120,), depths=(0.5,), continuation=4, decode_tokens=4)
    with pytest.raises(InvalidParameter, match="unknown kv cache 'lru'"):
        evaluate_long_context(model, config, progress=lambda row: pytest.fail("a row ran"))


def test_the_seed_flag_reaches_the_long_context_run(model, tmp_path):
    """--seed draws the pass keys of longctx too: the run's config records the seed it was given."""
    parser = eval_cli.ArgumentParser()
    eval_cli.add_arguments(parser)
    args = parser.parse_args(["longctx", "--policies", "full", "--lengths", "100", "--depths", "0.5",
                              "--continuation", "4", "--seed", "7", "--out", str(tmp_path)])
    assert eval_cli.run(args, model=model) == 0
    assert json.loads((tmp_path / "results.json").read_text())["config"]["seed"] == 7


def test_longctx_refuses_ray_before_loading():
    """Its rows share one long prompt on one machine: --ray is refused, before any model loads."""
    pytest.importorskip("ray")
    parser = eval_cli.ArgumentParser()
    eval_cli.add_arguments(parser)
    with pytest.raises(InvalidParameter, match="longctx runs on one machine"):
        eval_cli.run(parser.parse_args(["longctx", "--ray"]), model=lambda: pytest.fail("the model was loaded"))


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return LoadedModel(tiny_llama(seed=0, hidden_size=64, max_position=512), CharTokenizer(96), "tiny")


def test_the_nll_is_over_the_continuation_asked_not_the_decode_run(model, monkeypatch):
    """--continuation 4 scores 4 tokens after the context, even when the decode run reads more."""
    import decodekit.eval.longctx as longctx

    scored = []
    original = longctx.continuation_nll
    monkeypatch.setattr(longctx, "continuation_nll",
                        lambda backend, ids, context: scored.append(len(ids) - context) or original(backend, ids, context))
    config = LongContextConfig(policies=("full",), lengths=(120,), depths=(0.5,), continuation=4, decode_tokens=16)
    evaluate_long_context(model, config)
    assert scored == [4]


def test_the_pass_key_sits_at_the_nearest_whole_filler_to_its_depth():
    """The filler before the key is the whole number of sentences nearest depth x all of them."""
    tok = CharTokenizer(128)
    for length in range(300, 1600, 89):
        for depth in (0.1, 0.3, 0.7, 0.9):
            text = tok.decode(passkey_prompt(tok, length, depth, 12345))
            before = text[:text.index("The pass key is 12345")].count(FILLER)
            total = text.count(FILLER)
            assert abs(before - depth * total) <= 0.5, (length, depth, before, total)
