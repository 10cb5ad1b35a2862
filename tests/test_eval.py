"""`decodekit eval`: statistics on hand-computed cases, tasks, and an end-to-end run on a tiny model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import re

import pytest

from decodekit.eval import Item, Task, auroc, register_task, reliability_bins, wilson_interval
from decodekit.eval.cli import add_arguments, run
from decodekit.eval.metrics import Z95
from decodekit.eval.report import markdown
from decodekit.eval.runner import budget_curve
from decodekit.eval.tasks import capital_answer, capital_correct, capitals_task, gsm8k_gold, gsm8k_task
from decodekit.errors import InvalidParameter, UnknownMethod
from decodekit.interfaces.cli import main as cli_main
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tiny import tiny_llama


def test_wilson_interval_on_known_values():
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_auroc_on_hand_computed_cases():
    # Positives 0.35, 0.8 vs negatives 0.1, 0.4: 3 of 4 pairs ordered -> 0.75.
    assert auroc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)
    assert auroc([1, 2, 3], [False, True, True]) == 1.0
    assert auroc([3, 2, 1], [False, True, True]) == 0.0
    assert auroc([0.5, 0.5], [True, False]) == 0.5  # a tie counts one half
    assert auroc([0.2, 0.5, 0.5, 0.9], [False, True, False, True]) == pytest.approx(0.875)
    assert auroc([0.1, 0.2], [True, True]) is None


def test_reliability_bins():
    bins = reliability_bins([0.05, 0.15, 0.95, 0.99, 1.0], [False, True, True, True, False], bins=10)
    assert [(b["lo"], b["count"]) for b in bins] == [(0.0, 1), (0.1, 1), (0.9, 3)]
    assert bins[2]["accuracy"] == pytest.approx(2 / 3)


def test_reliability_bins_put_confidences_outside_0_1_in_the_end_bins_at_the_ends():
    """The bins cover [0, 1]: a signal a little outside it is clipped to the nearest end, so it lands
    in the first or last bin and the bin's mean confidence stays a probability."""
    bins = reliability_bins([-0.5, 1.5], [False, True], bins=4)
    assert bins == [{"lo": 0.0, "hi": 0.25, "count": 1, "confidence": 0.0, "accuracy": 0.0},
                    {"lo": 0.75, "hi": 1.0, "count": 1, "confidence": 1.0, "accuracy": 1.0}]


def test_capitals_task_matching():
    task = capitals_task()
    assert task.items[0].subject == "China" and task.items[0].gold == "Beijing"
    item = Item("BR", "", "Brasilia")
    assert capital_correct("The capital of Brazil is Brasília.", item)
    assert not capital_correct("Rio de Janeiro", item)
    assert capital_answer("The capital of France is Paris.\nIt is big.") == "paris"
    assert capital_correct("Astana", Item("KZ", "", "Nur-Sultan"))
    assert task.answer_start("The capital of Peru is Lima.") == len("The capital of Peru is ")
    assert task.answer_start("Peru's capital is Lima.") == len("Peru's capital is ")


@pytest.mark.parametrize("subject, gold, right, wrong", [
    ("Singapore", "Singapore", ["Singapore", "Singapore City.", "The capital of Singapore is Singapore."],
     ["Singapore does not have a capital.", "Singapore? I don't know."]),
    ("Luxembourg", "Luxembourg", ["Luxembourg City", "Luxembourg's capital is Luxembourg.",
                                  "Luxembourg City is the capital of Luxembourg.", "The capital is Luxembourg City."],
     ["Luxembourg's capital is Brussels.", "Luxembourg has Brussels as its capital"]),
    ("Guinea-Bissau", "Bissau", ["Bissau", "Guinea-Bissau's capital is Bissau.", "Bissau, Guinea-Bissau"],
     ["Guinea-Bissau", "Guinea-Bissau is a country"]),
    ("Sao Tome and Principe", "Sao Tome", ["São Tomé"], ["Sao Tome and Principe"]),
    ("Mexico", "Mexico City", ["Mexico City", "It is Mexico City."], ["Mexico", "Guadalajara, Mexico"]),
])
def test_a_capital_inside_its_countrys_name_is_not_answered_by_echoing_the_country(subject, gold, right, wrong):
    item = Item("X", "", gold, subject)
    assert all(capital_correct(text, item) for text in right)
    assert not any(capital_correct(text, item) for text in wrong)


def test_capital_answer_skips_lines_with_nothing_to_say():
    """The answer is the first non-empty line: a blank or punctuation-only line before it does not answer."""
    assert capital_answer("\n  \n...\nParis.") == "paris"
    assert capital_answer("\n \n") is None


def test_load_task_refuses_a_data_file_for_built_in_items_and_an_empty_one(tmp_path):
    """--data goes only to a task that reads a file, and a task with no items is an error, not an empty run."""
    from decodekit.eval.tasks import load_task

    with pytest.raises(InvalidParameter, match="has no data file"):
        load_task("capitals", str(tmp_path / "x.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InvalidParameter, match="has no items"):
        load_task("structured", str(empty))


def test_gsm8k_task_parsing(tmp_path):
    assert gsm8k_gold("so 3 + 4 = 7\n#### 1,234") == "1234"
    for answer in ("####", "blah #### 12 ####"):  # no number after the last '####': no answer could match it
        with pytest.raises(InvalidParameter, match="without a number after its last '####'"):
            gsm8k_gold(answer)
    with pytest.raises(InvalidParameter, match=r"more than one number after its last '####': '1/2'"):
        gsm8k_gold("#### 1/2")  # (its last number, 2, is not its value)
    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    task = gsm8k_task(data)
    assert len(task.items) == 1 and task.items[0].gold == "4"
    assert task.is_correct("2+2 = 4.0", task.items[0]) and not task.is_correct("5", task.items[0])
    with pytest.raises(InvalidParameter):
        gsm8k_task(tmp_path / "missing.jsonl")


def test_budget_curve_votes_over_the_first_m_samples():
    records = [{"candidates": [{"answer": "a", "correct": False}, {"answer": "b", "correct": True},
                               {"answer": "b", "correct": True}, {"answer": "c", "correct": False}]}]
    assert budget_curve(records) == [{"samples": 1, "accuracy": 0.0}, {"samples": 2, "accuracy": 0.0},
                                     {"samples": 4, "accuracy": 1.0}]
    three = [{"candidates": records[0]["candidates"][:3]}]  # N off the powers of two is the curve's last point
    assert [p["samples"] for p in budget_curve(three)] == [1, 2, 3]


def test_budget_curve_ends_at_the_fewest_samples_any_item_has():
    """Every point votes over m samples of every item: past the shortest item's count, that item
    would vote over fewer than m."""
    four = {"candidates": [{"answer": a, "correct": a == "b"} for a in "abbc"]}
    two = {"candidates": [{"answer": a, "correct": a == "b"} for a in "bb"]}
    assert [p["samples"] for p in budget_curve([four, two])] == [1, 2]


def test_budget_curve_scores_a_vote_with_no_answer_by_the_first_sample():
    """With no answer to vote on, the method's output is its first sample (as self-consistency's
    is), and the point scores that sample's correctness."""
    records = [{"candidates": [{"answer": None, "correct": True}, {"answer": None, "correct": False}]}]
    assert budget_curve(records) == [{"samples": 1, "accuracy": 1.0}, {"samples": 2, "accuracy": 1.0}]


def test_signal_aurocs_orient_each_signal_so_that_higher_means_likelier_correct():
    from decodekit.eval.runner import signal_aurocs

    # low phi_first (entropy) and high self-certainty both mark the correct answers here
    records = [{"signals": {"phi_first": phi, "self_certainty": -phi}, "correct": ok}
               for phi, ok in ((0.1, True), (0.2, True), (0.8, False), (0.9, False))]
    assert signal_aurocs(records) == {"phi_first": 1.0, "self_certainty": 1.0}


def fake_task() -> Task:
    items = [Item(str(i), q, q[0]) for i, q in enumerate(["abc", "bcd", "cde"])]
    return Task("fake3", items, answer=lambda t: t[:1] or None, is_correct=lambda t, item: t[:1] == item.gold,
                max_new_tokens=6)


def eval_args(tmp_path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["fake3", "--out", str(tmp_path), *argv])


def test_cot_in_eval_answers_with_the_tasks_extractor():
    from decodekit.eval.runner import EvalConfig, evaluate

    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    task = fake_task()
    result = evaluate(model, task, EvalConfig(method="cot", n=3, max_new_tokens=4))
    candidates = [(c, record["gold"]) for record in result["records"] for c in record["candidates"]]
    assert all(len(c["answer"]) == 1 and c["correct"] == (c["answer"] == gold) for c, gold in candidates)  # the task's: t[:1]


def test_the_budget_curve_leaves_out_answers_a_method_stopped_midway():
    """first-finish stops its other samples when the first finishes: their cut answers are no
    samples to vote over (they voted in the budget curve)."""
    from decodekit.eval.runner import EvalConfig, evaluate

    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    records = [record for seed in range(3)  # a random tiny model seldom ends early: a few runs
               for record in evaluate(model, fake_task(), EvalConfig(method="first-finish", n=4, max_new_tokens=6,
                                                                    seed=seed))["records"]]
    kept = sum(len(record.get("candidates", [])) for record in records)
    assert 0 < kept < 4 * len(records)  # the finished ones, not every sample drawn


@pytest.mark.parametrize("method", ["greedy", "self-consistency"])
def test_eval_end_to_end_on_a_tiny_model(tmp_path, method, capsys):
    register_task("fake3", fake_task)
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    args = eval_args(tmp_path, "--method", method, "--n", "4", "--signals", "agreement")
    assert run(args, model=model) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    records = result["records"]
    assert result["items"] == len(records) == 3
    assert all(r["correct"] == (r["output"][:1] == r["gold"]) for r in records)
    assert result["correct"] == sum(r["correct"] for r in records)
    assert result["ci95"] == pytest.approx(list(wilson_interval(result["correct"], 3)))
    assert all(r["signals"].get("agreement") is not None for r in records)
    assert set(result["auroc"]) >= {"phi_first", "agreement", "self_certainty"}
    assert (tmp_path / "report.md").read_text().startswith("# decodekit eval: fake3")
    assert (tmp_path / "plot.png").stat().st_size > 1000
    if method == "self-consistency":
        assert result["budget_curve"][-1]["samples"] == 4
    assert "accuracy" in capsys.readouterr().out
    # a command that reproduces the run: its flags parse to the run's, given before the task or after
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    given = ["--n", "4", "--method", method, "fake3", "--out", str(tmp_path), "--signals", "agreement"]
    assert vars(parser.parse_args(shlex.split(result["command"])[2:])) == vars(args) == vars(parser.parse_args(given))


def test_results_record_n_only_where_something_drew_n_samples():
    """--n (default 8) counts a method's samples and --signals agreement's: a greedy run without the
    signal draws one answer, so its results say n null and its report names no n."""
    from decodekit.eval.runner import EvalConfig, evaluate

    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    for config, n in ((EvalConfig(), None), (EvalConfig(method="self-consistency", n=3), 3),
                      (EvalConfig(n=3, signals=["agreement"]), 3)):
        result = evaluate(model, fake_task(), dataclasses.replace(config, max_new_tokens=2, limit=1))
        assert result["n"] == n, config
        assert (", n 3," in markdown(result)) == (n is not None)


def test_signal_tokens_add_up_every_extra_signals_samples(monkeypatch):
    """An item's signal_tokens is what all its extra signals spent: the agreement samples' tokens and
    the paraphrases' tokens together."""
    import decodekit.eval.runner as runner
    from decodekit.eval.runner import EvalConfig, evaluate

    monkeypatch.setattr(runner, "sampled_agreement", lambda *a, **kw: {"agreement": 0.5, "tokens_spent": 3})
    monkeypatch.setattr(runner, "paraphrase_consistency", lambda *a, **kw: {"pc": 0.25, "tokens_spent": 5})
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    result = evaluate(model, fake_task(), EvalConfig(max_new_tokens=2, signals=["agreement", "pc"], paraphrases=2))
    assert [r["signal_tokens"] for r in result["records"]] == [8, 8, 8]
    assert result["signal_tokens"] == 24


def test_eval_rejects_bad_input(tmp_path):
    register_task("fake3", fake_task)
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    with pytest.raises(UnknownMethod):
        run(eval_args(tmp_path, "--method", "nope"), model=model)
    with pytest.raises(InvalidParameter):
        run(eval_args(tmp_path, "--signals", "vibes"), model=model)
    with pytest.raises(InvalidParameter):
        run(eval_args(tmp_path, "--method", "beam", "--opt", "width=2"), model=model)
    with pytest.raises(InvalidParameter, match="--n"):  # one n, which the report and the budget curve read
        run(eval_args(tmp_path, "--method", "self-consistency", "--opt", "n=2"), model=model)
    # a value never silently over another, and no flag silently ignored (the report would name it)
    with pytest.raises(InvalidParameter, match=r"^--opt max_ngram=\.\.\. is given twice; give one$"):
        run(eval_args(tmp_path, "--method", "pld", "--opt", "max_ngram=3", "--opt", "max_ngram=4"), model=model)
    for method in ("greedy", "pld"):
        with pytest.raises(InvalidParameter, match=f"^--n 3: method '{method}' draws one answer"):
            run(eval_args(tmp_path, "--method", method, "--n", "3"), model=model)
    assert cli_main(["eval", "no-such-task"]) == 2


def test_paraphrases_are_distinct_rephrasings_and_never_the_question_itself():
    from decodekit.search.uncertainty import PARAPHRASE_TEMPLATES, paraphrases

    question = "What is 2 + 2?"
    every = paraphrases(question, len(PARAPHRASE_TEMPLATES))
    assert len(set(every)) == len(every) and question not in every
    assert all(question in p for p in every)
    with pytest.raises(InvalidParameter, match="paraphrases"):  # a repeat would count one answer twice
        paraphrases(question, len(PARAPHRASE_TEMPLATES) + 1)
    for k in (0, -1):  # (a negative k counted from the end)
        with pytest.raises(InvalidParameter, match="paraphrases"):
            paraphrases(question, k)
    capitals = capitals_task()
    item = capitals.items[0]
    five = capitals.paraphrase(item, 5)
    assert len(set(five)) == 5 and item.question not in five
    with pytest.raises(InvalidParameter, match="paraphrases"):
        capitals.paraphrase(item, 6)


def test_eval_refuses_more_paraphrases_than_the_task_has_before_loading(tmp_path):
    register_task("fake3", fake_task)
    with pytest.raises(InvalidParameter, match="paraphrases"):
        run(eval_args(tmp_path, "--signals", "pc", "--paraphrases", "50"), model=lambda: pytest.fail("the model was loaded"))


def test_the_default_output_folder_is_checked_before_any_work(tmp_path, monkeypatch):
    register_task("fake3", fake_task)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval-out").mkdir()
    (tmp_path / "eval-out" / "fake3-greedy").write_text("a file where the folder goes")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(InvalidParameter, match="eval-out/fake3-greedy"):
        run(parser.parse_args(["fake3"]), model=lambda: pytest.fail("the model was loaded"))


@pytest.mark.real_model
def test_real_model_greedy_signals_and_judge(real_model):
    from decodekit.engine import Engine, make_sampler
    from decodekit.engine.core import Request
    from decodekit.engine import build_decoder
    from decodekit.search import SampleDecoder

    task = capitals_task()
    ids = real_model.prompt_ids(task.items[0].question)
    plain = Engine(real_model).generate(ids, max_new_tokens=12)
    got = SampleDecoder(task.answer_start).generate(real_model, Request(ids, make_sampler("greedy", {}), 12))
    assert got.tokens == plain.tokens
    assert 0.0 <= got.extra["uncertainty"]["phi_first"] <= 1.0
    judged = build_decoder("best-of-n", n=2, scorer="judge").generate(
        real_model, Request(ids, make_sampler("best-of-n", {"seed": 0}), 8))
    assert all(0.0 < c["score"] < 1.0 for c in judged.extra["candidates"])


def test_report_says_when_accuracy_is_low():

    base = {"task": "gsm8k", "method": "greedy", "seed": 0, "n": None, "options": {}, "correct": 0, "items": 10,
            "tokens_spent": 10, "signal_tokens": 0, "time_s": 1.0, "auroc": {}, "budget_curve": [], "records": []}
    low = markdown({**base, "accuracy": 0.0, "ci95": [0.0, 0.278]})
    high = markdown({**base, "accuracy": 0.8, "correct": 8, "ci95": [0.49, 0.94]})
    assert "Accuracy is low" in low
    assert "Accuracy is low" not in high


def test_the_budget_curve_names_what_it_votes_over():
    """CoT-decoding's candidates are its first-token branches, not samples."""

    curve = [{"samples": 1, "accuracy": 0.5}, {"samples": 2, "accuracy": 0.5}]
    base = {"task": "gsm8k", "seed": 0, "n": 2, "options": {}, "correct": 1, "items": 2, "accuracy": 0.5,
            "ci95": [0.1, 0.9], "tokens_spent": 10, "signal_tokens": 0, "time_s": 1.0, "auroc": {},
            "budget_curve": curve, "records": []}
    assert "over the first m decoding paths" in markdown({**base, "method": "cot"})
    assert "over the first m samples" in markdown({**base, "method": "self-consistency"})


def test_gsm8k_data_ships_inside_the_package():
    task = gsm8k_task()  # the packaged file, wherever the package is installed
    assert len(task.items) == 660
    assert all(item.gold for item in task.items)


def test_structured_corpus_is_valid_and_compiles():
    """Every packaged schema is a valid draft 2020-12 schema that llguidance compiles, and the
    judge is jsonschema's verdict on the output."""
    jsonschema = pytest.importorskip("jsonschema")
    from decodekit.eval.tasks import schema_valid, structured_task
    from decodekit.samplers.constraint import checked_grammar

    task = structured_task()
    assert len(task.items) >= 70 and len({i.id for i in task.items}) == len(task.items)
    for item in task.items:
        jsonschema.Draft202012Validator.check_schema(json.loads(item.gold))
        checked_grammar(item.constraint)
    person = next(i for i in task.items if i.id == "app-person")
    assert schema_valid('{"name": "Ann", "age": 31, "city": "Lisbon"}', person)
    assert not schema_valid('{"name": "Ann", "age": 331, "city": "Lisbon"}', person)
    assert not schema_valid('{"name": "Ann", "age": 31', person)


@pytest.mark.parametrize("row, message", [
    ({"question": "q", "answer": "two"}, "GSM8K answer without '####': 'two'"),
    ({"question": " ", "answer": "#### 2"}, "a GSM8K problem needs a non-empty 'question'"),
    ({"question": "q"}, "a GSM8K problem needs a non-empty 'question' and an 'answer' string"),
])
def test_a_bad_gsm8k_problem_is_one_line_naming_its_line(tmp_path, row, message):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(InvalidParameter, match=f"^{re.escape(str(path))}:2: {re.escape(message)}"):
        gsm8k_task(path)


def test_a_data_file_with_a_repeated_item_id_is_refused(tmp_path):
    """Records and reports are keyed by the id: two items with one id would be two records with it."""
    from decodekit.eval.tasks import load_task

    path = tmp_path / "s.jsonl"
    row = {"id": "a", "prompt": "p", "schema": {"type": "integer"}}
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "prompt": "q"}) + "\n")
    with pytest.raises(InvalidParameter, match=r"^task 'structured': item id 'a' appears twice in "):
        load_task("structured", str(path))
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "id": "b"}) + "\n")
    assert [item.id for item in load_task("structured", str(path)).items] == ["a", "b"]


def test_structured_eval_decodes_under_each_items_schema(tmp_path):
    """On a tiny model: constrained outputs that ended by themselves are all valid, and the
    constrained run is valid more often than the same run without the schema."""
    pytest.importorskip("jsonschema")
    from decodekit.eval.runner import EvalConfig, evaluate
    from decodekit.eval.tasks import structured_task

    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    task = structured_task()
    task.items = [i for i in task.items if i.id.startswith(("enum", "const", "type", "app-sentiment"))][:8]
    constrained = evaluate(model, task, EvalConfig(max_new_tokens=64))
    free = evaluate(model, task, EvalConfig(max_new_tokens=64, constrained=False))
    assert constrained["correct"] > free["correct"]
    for record in constrained["records"]:
        if len(record["output"]) < 60:  # ended before the budget: must be valid
            assert record["correct"], record


def test_the_longctx_help_states_the_defaults_it_runs():
    """``decodekit eval --help`` names longctx's defaults without importing torch: the text is
    checked against the values here."""
    import argparse

    from decodekit.eval.cli import add_arguments
    from decodekit.eval.longctx import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_POLICIES, LongContextConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    assert f"(default: {'; '.join(DEFAULT_POLICIES)})" in helps["policies"]
    assert f"(default {','.join(map(str, DEFAULT_LENGTHS))})" in helps["lengths"]
    assert f"(default {','.join(map(str, DEFAULT_DEPTHS))})" in helps["depths"]
    assert f"(default {LongContextConfig().continuation})" in helps["continuation"]


def test_a_structured_file_takes_boolean_schemas_and_is_checked_whole_before_any_decoding(tmp_path):
    from decodekit.eval.tasks import load_task

    path = tmp_path / "items.jsonl"
    good = {"id": "a", "prompt": "Any JSON:", "schema": True}
    path.write_text(json.dumps(good) + "\n")
    assert [item.id for item in load_task("structured", str(path)).items] == ["a"]
    path.write_text(json.dumps(good) + "\n" + json.dumps({"id": "b", "prompt": "x", "schema": {"const": 2**60}}) + "\n")
    with pytest.raises(InvalidParameter, match=r"items.jsonl:2: the JSON schema's const"):
        load_task("structured", str(path))


def test_a_structured_data_path_that_is_no_file_is_bad_input(tmp_path, capsys):
    """A missing file or a folder given as --data is the user's mistake: one line and exit code 2,
    as for gsm8k, not the exit code 1 of a failed read."""
    for where, said in ((tmp_path / "missing.jsonl", "not found"), (tmp_path, "is a folder: give a file")):
        assert cli_main(["eval", "structured", "--data", str(where), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"structured data {str(where)!r} {said}" in err


def test_agreement_samples_are_drawn_under_the_items_schema_and_apart_from_the_answer(monkeypatch):
    """The agreement signal's samples: under the item's constraint (a `const` schema leaves one
    answer, so they all agree with it), from seeds of their own (never the answer's draws, which
    would put the answer among them), and no two items share a sample's seeds."""
    pytest.importorskip("jsonschema")
    import decodekit.eval.runner as runner
    from decodekit.eval.runner import EvalConfig, evaluate
    from decodekit.eval.tasks import structured_task

    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    probes, drawn = [], []
    original = runner.sampled_agreement

    def spy(model, probe, answer, extract, n=8, **kw):
        probes.append(probe.sampler.seed)
        return original(model, probe, answer, extract, n=n, **kw)

    monkeypatch.setattr(runner, "sampled_agreement", spy)
    task = structured_task()
    task.items = [i for i in task.items if i.id.startswith("const")][:2]
    result = evaluate(model, task, EvalConfig(max_new_tokens=48, n=3, signals=["agreement"]))
    assert [r["signals"]["agreement"] for r in result["records"]] == [1.0, 1.0]

    original_run = runner.run_item
    monkeypatch.setattr(runner, "run_item", lambda *a: drawn.append(a[5]) or original_run(*a))
    probes.clear()
    evaluate(model, fake_task(), EvalConfig(method="sample", temperature=0.7, n=4, signals=["agreement"]))
    rows = [set(range(s, s + 4)) for s in drawn + probes]  # each item's and each probe's seeds
    assert all(not (a & b) for i, a in enumerate(rows) for b in rows[i + 1:])


# A stand-in method, for what the runner does around any method's output ----------------------------


class ScriptedDecoder:
    """A method whose output is given: ``reply(prompt)`` -> (text, extra, stats.extra); it keeps every request."""

    def __init__(self, reply, new_tokens: int = 2):
        self.reply, self.new_tokens, self.requests = reply, new_tokens, []

    def generate(self, model, request):
        from decodekit.engine.core import Generation, GenerationStats

        self.requests.append(request)
        text, extra, stats_extra = self.reply(model.tokenizer.decode(request.prompt_ids))
        return Generation(text, [0] * self.new_tokens, GenerationStats(new_tokens=self.new_tokens, extra=stats_extra),
                          "length", extra)


def scripted_eval(monkeypatch, decoder, **config):
    import decodekit.eval.runner as runner
    from decodekit.eval.runner import EvalConfig, evaluate

    monkeypatch.setattr(runner, "make_decoder", lambda config, task: decoder)
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    return evaluate(model, fake_task(), EvalConfig(**config))


def test_an_items_tokens_spent_is_what_its_whole_search_spent(monkeypatch):
    """A search's cost is every token it decoded (stats.extra['tokens_spent']), not the answer's length;
    a method that reports none spent the answer's tokens."""
    searched = ScriptedDecoder(lambda prompt: ("a", {}, {"tokens_spent": 9}), new_tokens=2)
    result = scripted_eval(monkeypatch, searched, method="self-consistency")
    assert [r["tokens_spent"] for r in result["records"]] == [9, 9, 9] and result["tokens_spent"] == 27
    plain = ScriptedDecoder(lambda prompt: ("a", {}, {}), new_tokens=2)
    assert scripted_eval(monkeypatch, plain)["tokens_spent"] == 6


def test_a_methods_own_agreement_is_kept_and_costs_no_extra_samples(monkeypatch):
    """Voting methods report agreement over their own samples: --signals agreement then draws none."""
    import decodekit.eval.runner as runner

    monkeypatch.setattr(runner, "sampled_agreement", lambda *a, **kw: pytest.fail("agreement sampled again"))
    voter = ScriptedDecoder(lambda prompt: ("a", {"uncertainty": {"agreement": 0.75}}, {}))
    result = scripted_eval(monkeypatch, voter, method="self-consistency", signals=["agreement"])
    assert [r["signals"]["agreement"] for r in result["records"]] == [0.75] * 3
    assert result["signal_tokens"] == 0


def test_every_item_is_decoded_with_the_max_new_tokens_asked_for_else_the_tasks(monkeypatch):
    """--max-new-tokens overrides the task's own budget (fake3's is 6)."""
    asked = ScriptedDecoder(lambda prompt: ("a", {}, {}))
    scripted_eval(monkeypatch, asked, max_new_tokens=3)
    assert [r.max_new_tokens for r in asked.requests] == [3, 3, 3]
    default = ScriptedDecoder(lambda prompt: ("a", {}, {}))
    scripted_eval(monkeypatch, default)
    assert [r.max_new_tokens for r in default.requests] == [6, 6, 6]


def test_accuracy_and_its_interval_count_the_items_evaluated_not_the_whole_task(monkeypatch):
    """With --limit 2 of fake3's 3 items, and "a" right for the first item only: 1 of 2, Wilson(1, 2)."""
    always_a = ScriptedDecoder(lambda prompt: ("a", {}, {}))
    result = scripted_eval(monkeypatch, always_a, limit=2)
    assert len(always_a.requests) == 2 and [r["id"] for r in result["records"]] == ["0", "1"]
    assert (result["items"], result["correct"], result["accuracy"]) == (2, 1, 0.5)
    assert result["ci95"] == pytest.approx(list(wilson_interval(1, 2)))


def test_each_candidate_is_judged_by_its_own_text_not_the_chosen_output(monkeypatch):
    """The budget curve scores votes over candidates: each candidate's correctness is its own."""
    candidates = [{"text": "abc", "answer": "a"}, {"text": "zzz", "answer": "z"}]
    chooser = ScriptedDecoder(lambda prompt: ("zzz", {"candidates": candidates}, {}))
    result = scripted_eval(monkeypatch, chooser, method="self-consistency", limit=1)
    record = result["records"][0]  # item 0, gold "a"
    assert record["correct"] is False
    assert record["candidates"] == [{"answer": "a", "correct": True}, {"answer": "z", "correct": False}]


def test_a_plain_method_with_an_option_is_refused():
    """greedy and sample take no method options: one given is an error, not silently dropped."""
    from decodekit.eval.runner import EvalConfig, evaluate

    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    with pytest.raises(InvalidParameter):
        evaluate(model, fake_task(), EvalConfig(method="greedy", options={"width": 2}))


def test_the_budget_curve_is_drawn_only_when_every_item_has_candidates():
    """A curve over the items that have candidates alone would not be the task's accuracy."""
    voted = {"candidates": [{"answer": "a", "correct": True}, {"answer": "a", "correct": True}]}
    assert budget_curve([voted, {"signals": {}}]) == []
    assert budget_curve([voted]) == [{"samples": 1, "accuracy": 1.0}, {"samples": 2, "accuracy": 1.0}]


def test_a_signals_auroc_is_over_the_items_that_have_it():
    """An item without a signal is left out of that signal's AUROC, not scored as 0."""
    from decodekit.eval.runner import signal_aurocs

    records = [{"signals": {"x": 0.9}, "correct": True}, {"signals": {"x": 0.1}, "correct": False},
               {"signals": {}, "correct": True}]
    assert signal_aurocs(records) == {"x": 1.0}


def test_gsm8k_judges_the_final_number_by_its_value():
    """Correct when the final number equals the reference's: 7.0 is 7, 7.5 is not."""
    from decodekit.eval.tasks import numbers_equal

    assert numbers_equal("7.0", "7") and numbers_equal("7", "7")
    assert not numbers_equal("7.5", "7") and not numbers_equal("6.99", "7") and not numbers_equal(None, "7")
    assert not numbers_equal("12345678901234567891", "12345678901234567890")  # (equal as floats)
    assert numbers_equal("0.1", ".1000000001") and not numbers_equal("0.1", "0.100002")


def test_numbers_equal_compares_what_float_cannot_read_as_text():
    """A value float() cannot read (a gold like "1/2") still matches the same text, and only it."""
    from decodekit.eval.tasks import numbers_equal

    assert numbers_equal("1/2", "1/2")
    assert not numbers_equal("1/2", "0.5") and not numbers_equal("7", "n/a")


REPORT_BASE = {"task": "gsm8k", "method": "greedy", "seed": 0, "n": None, "options": {}, "correct": 2, "items": 10,
               "accuracy": 0.2, "ci95": [0.057, 0.51], "tokens_spent": 100, "signal_tokens": 0, "time_s": 1.0,
               "auroc": {}, "budget_curve": [], "records": []}


def test_python_api_configs_refuse_a_limit_or_continuation_of_0():
    """The CLI refuses them; through the Python API a limit of 0 ran every item, and a continuation of
    0 divided by 0 at the end of a long-context run."""
    from decodekit.eval.longctx import LongContextConfig
    from decodekit.eval.runner import EvalConfig

    with pytest.raises(InvalidParameter, match="^limit must be an integer >= 1, got 0"):
        EvalConfig(limit=0)
    with pytest.raises(InvalidParameter, match=r"^continuation must be an integer in \[1, 1048576\], got 0"):
        LongContextConfig(continuation=0)
    assert EvalConfig(limit=None).limit is None and EvalConfig(limit=2).limit == 2


def test_the_low_accuracy_warning_reads_the_upper_bound():
    """Warned only when even the 95% upper bound is below 30%: an interval reaching above it is not."""

    assert "Accuracy is low" not in markdown({**REPORT_BASE, "ci95": [0.1, 0.6]})
    low = markdown({**REPORT_BASE, "ci95": [0.0, 0.25], "auroc": {"mean_logprob": 0.7}}).splitlines()
    assert "Accuracy is low" in "\n".join(low)
    # the warning before the table, whose rows follow its header: a table cut in two shows as text
    header = low.index("| signal | direction | AUROC |")
    assert low[header + 1] == "|---|---|---|" and low[header + 2].startswith("| mean_logprob |")
    assert any("Accuracy is low" in line for line in low[:header])


def test_the_report_states_per_item_figures_and_each_signals_direction():
    """Tokens per item divide by the items evaluated; phi_first (entropy) is confident when low."""

    text = markdown({**REPORT_BASE, "auroc": {"phi_first": 0.8, "agreement": 0.6, "pc": None}})
    assert "tokens spent by the method: 100 (10.0 per item)" in text and "(0.10 s per item)" in text
    assert "- accuracy: **0.200** (2/10), 95% Wilson CI [0.057, 0.510]" in text  # correct of the items
    assert "| phi_first | lower = confident | 0.800 |" in text
    assert "| agreement | higher = confident | 0.600 |" in text and "| pc | higher = confident | n/a |" in text


def test_an_answer_with_a_pipe_keeps_the_items_table_in_four_columns():

    record = {"id": "0", "gold": "4", "answer": "4 | 5", "correct": False}
    rows = [line for line in markdown({**REPORT_BASE, "records": [record]}).splitlines() if line.startswith("| 0 |")]
    assert rows == ["| 0 | 4 | 4 \\| 5 | no |"]


def test_a_schema_gold_and_a_multi_line_answer_keep_the_items_table_in_four_columns():
    """A structured item's gold is its schema (a pattern may hold a pipe) and an unconstrained
    answer may span lines: each stays inside its cell."""

    record = {"id": "s1", "gold": '{"pattern": "^(a|b)$"}', "answer": '{\n "a": 1}', "correct": True}
    items = markdown({**REPORT_BASE, "records": [record]}).split("## Items")[1].strip().splitlines()
    assert len(items) == 3 and items[2].startswith("| s1 |") and items[2].endswith("| yes |")
    assert items[2].replace("\\|", "").count("|") == 5


def test_a_long_answer_is_cut_to_60_characters_in_the_items_table():

    record = {"id": "0", "gold": "4", "answer": "7" * 59 + "89", "correct": False}
    rows = [line for line in markdown({**REPORT_BASE, "records": [record]}).splitlines() if line.startswith("| 0 |")]
    assert rows == [f"| 0 | 4 | {'7' * 59 + '8'} | no |"]


def test_a_ray_runs_report_names_each_worker_and_the_lost_ones():

    machines = [{"host": "a", "pid": 1, "units": 7, "lost": False}, {"host": "b", "pid": 2, "units": 3, "lost": True}]
    assert "- Ray workers: a pid 1, 7 items; b pid 2, 3 items (lost)\n" in markdown({**REPORT_BASE, "machines": machines})
    assert "Ray workers" not in markdown(REPORT_BASE)


def test_a_report_without_items_has_no_plot(tmp_path):
    """Nothing was evaluated (an empty data file's run): the report and results, no empty plot."""
    from decodekit.eval.report import write_report

    paths = write_report({**REPORT_BASE, "records": []}, tmp_path / "out", {"command": "decodekit eval"})
    assert sorted(p.name for p in paths) == sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.md", "results.json"]


def test_the_reliability_plot_orients_each_signal_as_its_auroc_does():
    """A signal that is confident when low (phi_first) is flipped into a confidence, as for AUROC."""
    from decodekit.eval.report import CALIBRATION_SIGNALS
    from decodekit.search.uncertainty import CONFIDENCE_DIRECTION

    for name, to_confidence in CALIBRATION_SIGNALS.items():
        rising = to_confidence(0.8) > to_confidence(0.2)
        assert rising == (CONFIDENCE_DIRECTION.get(name, 1) > 0), name
        assert 0.0 <= to_confidence(0.2) <= 1.0 and 0.0 <= to_confidence(0.8) <= 1.0


def test_an_unconstrained_run_has_a_default_folder_of_its_own(tmp_path):
    """--unconstrained is run to compare with the constrained run: it must not overwrite that run's files."""
    from decodekit.eval.cli import output_folder
    from decodekit.eval.tasks import LONG_CONTEXT

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    folders = {output_folder(parser.parse_args(["structured", *flags]), LONG_CONTEXT) for flags in ([], ["--unconstrained"])}
    assert {str(f) for f in folders} == {"eval-out/structured-greedy", "eval-out/structured-greedy-unconstrained"}


def test_the_reproducing_command_keeps_every_repeated_opt(tmp_path):
    """--opt is repeatable: the command that reproduces a run names each option given, not only the last."""
    from decodekit.eval.cli import command_line

    args = eval_args(tmp_path, "--method", "best-of-n", "--opt", "a=1", "--opt", "b=2")
    parts = shlex.split(command_line(args))
    assert [parts[i + 1] for i, part in enumerate(parts) if part == "--opt"] == ["a=1", "b=2"]


def test_the_report_lists_every_item_of_a_small_run_and_its_interval_low_to_high():
    """The items table is the run's items in order (a dozen is far below the table's cap), and the
    Wilson interval reads [lower, upper]."""

    records = [{"id": str(i), "gold": "4", "answer": "4" if i % 2 else "5", "correct": bool(i % 2)} for i in range(12)]
    text = markdown({**REPORT_BASE, "records": records})
    rows = [line for line in text.split("## Items", 1)[1].splitlines() if line.startswith("| ") and "gold" not in line]
    assert rows == [f"| {i} | 4 | {'4' if i % 2 else '5'} | {'yes' if i % 2 else 'no'} |" for i in range(12)]
    assert "95% Wilson CI [0.057, 0.510]" in text


def test_a_gsm8k_prompt_is_the_instruction_then_the_problem(tmp_path):
    """The model is told to end with a number (what the extractor reads), then given the problem as written."""
    from decodekit.eval.tasks import GSM8K_INSTRUCTION

    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps({"question": "What is 2+2?", "answer": "#### 4"}) + "\n")
    assert gsm8k_task(data).items[0].question == GSM8K_INSTRUCTION + "What is 2+2?"


def test_a_capitals_answer_drops_every_lead_in_the_paraphrases_invite():
    """"The capital of X is (the city of)" and "X's capital is (the city of)" lead in; the city that follows is the answer."""
    from decodekit.eval.tasks import capital_answer_start

    for lead in ("The capital of France is the city of ", "France's capital is ", "France's capital city is the city of "):
        assert capital_answer(lead + "Paris.") == "paris", lead
        assert capital_answer_start(lead + "Paris.") == len(lead), lead


def test_a_capital_is_named_by_whole_words_not_inside_another_word():
    """"Limassol" is not Lima, "Romeo" is not Rome: the name must stand as words of its own."""
    assert not capital_correct("Limassol", Item("PE", "", "Lima", "Peru"))
    assert not capital_correct("Romeo", Item("IT", "", "Rome", "Italy"))
    assert capital_correct("It is Lima.", Item("PE", "", "Lima", "Peru"))


@pytest.mark.parametrize("gold, country, wrong, right", [
    ("Paris", "France", ["not Paris", "The capital of France is not Paris, it is Lyon.", "It isn't Paris."],
     ["No, Paris.", "Paris, not Lyon", "The capital of France is Paris."]),
    ("Santiago", "Chile", ["Santiago de Cuba"], ["Santiago de Chile", "Santiago"]),
    ("Victoria", "Seychelles", ["Victoria Falls"], ["Victoria, Seychelles"]),
    ("Jerusalem", "Israel", ["East Jerusalem"], ["Jerusalem"]),
    ("Mexico City", "Mexico", ["New Mexico City"], ["Mexico City"]),
    ("Bissau", "Guinea-Bissau", ["Guinea-Bissau's capital is not Bissau"], ["Bissau, Guinea-Bissau"]),
])
def test_a_capital_denied_or_inside_a_longer_place_name_is_not_an_answer(gold, country, wrong, right):
    """The name found as words is not enough: "not Paris" denies it, and "Santiago de Cuba" or "East
    Jerusalem" name other places; a comma or a full stop ends the name ("No, Paris.")."""
    item = Item("X", "", gold, country)
    assert not [text for text in wrong if capital_correct(text, item)]
    assert all(capital_correct(text, item) for text in right)


def test_a_structured_answer_is_the_output_stripped_and_a_blank_one_is_no_answer(tmp_path):
    """Votes compare the JSON text itself: surrounding whitespace is not part of it, and an empty output votes for nothing."""
    from decodekit.eval.tasks import structured_task

    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "Any JSON:", "schema": True}) + "\n")
    task = structured_task(path)
    assert task.answer(' {"a": 1}\n') == '{"a": 1}'
    assert task.answer(" \n") is None and task.answer("") is None


def test_a_structured_item_without_an_id_is_named_the_same_however_its_file_is_named(tmp_path, monkeypatch):
    """The default id (file name and line) is part of the items' digest: the same file given as a
    relative or an absolute path is the same task to --resume."""
    from decodekit.eval.checkpoint import items_digest
    from decodekit.eval.tasks import structured_task

    (tmp_path / "s.jsonl").write_text(json.dumps({"prompt": "Any JSON:", "schema": True}) + "\n")
    monkeypatch.chdir(tmp_path)
    relative, absolute = structured_task("s.jsonl"), structured_task(tmp_path / "s.jsonl")
    assert [item.id for item in relative.items] == [item.id for item in absolute.items] == ["s.jsonl:1"]
    assert items_digest(relative) == items_digest(absolute)


def test_longctx_flags_given_to_an_item_task_are_refused(tmp_path):
    """Each of --policies, --lengths, --depths, --continuation applies to longctx only: never silently ignored."""
    register_task("fake3", fake_task)
    for flag, value in (("--policies", "full"), ("--lengths", "100"), ("--depths", "0.5"), ("--continuation", "8")):
        with pytest.raises(InvalidParameter, match=f"^{flag} applies to longctx only"):
            run(eval_args(tmp_path, flag, value), model=lambda: pytest.fail("the model was loaded"))


class _Loaded(Exception):
    """Raised by a stand-in for the model loader or the evaluation: what it was given, no work done."""


def test_an_item_task_loads_its_model_with_the_kv_cache_asked_for(tmp_path, monkeypatch):
    """--kv-cache applies to the item tasks: the model is loaded with it."""
    import decodekit.models

    def load_model(name, **kwargs):
        raise _Loaded(kwargs)

    monkeypatch.setattr(decodekit.models, "load_model", load_model)
    register_task("fake3", fake_task)
    with pytest.raises(_Loaded) as loaded:
        run(eval_args(tmp_path, "--kv-cache", "int8"))
    assert loaded.value.args[0]["kv_cache"] == "int8"


def test_unconstrained_decodes_without_the_schema_and_the_default_under_it(tmp_path, monkeypatch):
    """--unconstrained leaves the items' schemas out of the decoding; without it they are followed."""
    import decodekit.eval.runner as runner

    def evaluate(model, task, config, progress=None, **resume):
        raise _Loaded(config.constrained)

    monkeypatch.setattr(runner, "evaluate", evaluate)
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "Any JSON:", "schema": {"type": "integer"}}) + "\n")
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flags, constrained in (([], True), (["--unconstrained"], False)):
        with pytest.raises(_Loaded) as got:
            run(parser.parse_args(["structured", "--data", str(path), "--out", str(tmp_path), *flags]), model=model)
        assert got.value.args[0] is constrained, flags


def test_longctx_has_one_default_folder_whatever_the_method_default():
    """The help promises eval-out/longctx for longctx (it runs no --method)."""
    from decodekit.eval.cli import output_folder
    from decodekit.eval.tasks import LONG_CONTEXT

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert str(output_folder(parser.parse_args(["longctx"]), LONG_CONTEXT)) == "eval-out/longctx"


def test_the_reproducing_command_gives_a_switch_without_a_value(tmp_path):
    """--unconstrained takes no value: the command names it alone, and parses back to the run's flags."""
    from decodekit.eval.cli import command_line

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["structured", "--unconstrained", "--out", str(tmp_path)])
    parts = shlex.split(command_line(args))
    assert "--unconstrained" in parts and "True" not in parts
    assert vars(parser.parse_args(parts[2:])) == vars(args)


def test_python_m_decodekit_eval_reports_a_bad_argument_in_one_line_with_status_2(capsys):
    """Like the decodekit command: a refused argument is one line on stderr and exit status 2."""
    from decodekit.eval.cli import main

    assert main(["no-such-task"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodekit eval: error: unknown task 'no-such-task'") and err.count("\n") == 1


# --------------------------------------------------------------------------- checkpoint and --resume


def test_an_interrupted_eval_resumes_with_the_records_one_run_gives(tmp_path, monkeypatch):
    """A run stopped after its second item, resumed with a larger --limit, decodes only the items it
    lacks, and its results equal an uninterrupted run's (each item has its own seed)."""
    import decodekit.eval.runner as runner

    register_task("fake3", fake_task)
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    settings = ("--method", "self-consistency", "--n", "3", "--temperature", "0.9")
    assert run(eval_args(tmp_path / "whole", *settings), model=model) == 0
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())

    decoded, real = [], runner.run_item

    def stopping(model, task, config, decoder, item, seed, max_new):
        if len(decoded) == 2:
            raise KeyboardInterrupt
        decoded.append(item.id)
        return real(model, task, config, decoder, item, seed, max_new)

    monkeypatch.setattr(runner, "run_item", stopping)
    with pytest.raises(KeyboardInterrupt):
        run(eval_args(tmp_path / "cut", *settings), model=model)
    saved = json.loads((tmp_path / "cut" / "checkpoint.json").read_text())
    assert sorted(saved["records"]) == ["0", "1"] and not (tmp_path / "cut" / "results.json").exists()

    from decodekit.bench.checkpoint import HEADER, digest

    saved["seconds"] = {"0": 5.0, "1": 7.0}  # times that tell the items apart (a tiny model's are ~0)
    saved["digest"] = digest({k: v for k, v in saved.items() if k not in HEADER})
    (tmp_path / "cut" / "checkpoint.json").write_text(json.dumps(saved))
    decoded.clear()
    monkeypatch.setattr(runner, "run_item", lambda *a: decoded.append(a[4].id) or real(*a))
    assert run(eval_args(tmp_path / "cut", *settings, "--limit", "1", "--resume"), model=model) == 0
    limited = json.loads((tmp_path / "cut" / "results.json").read_text())
    assert decoded == [] and limited["items"] == 1 and limited["time_s"] == 5.0  # item 0's time alone
    assert run(eval_args(tmp_path / "cut", *settings, "--resume"), model=model) == 0
    assert decoded == ["2"]  # only the item the first run did not reach
    resumed = json.loads((tmp_path / "cut" / "results.json").read_text())
    assert 12.0 <= resumed["time_s"] < 12.0 + whole["time_s"] + 5  # the saved items' time and this run's
    assert resumed["resumed_items"] == 2 and whole["resumed_items"] == 0
    same = ("id", "output", "answer", "correct", "tokens_spent", "signals", "candidates")
    assert [{k: r.get(k) for k in same} for r in resumed["records"]] == [{k: r.get(k) for k in same} for r in whole["records"]]
    assert {k: resumed[k] for k in ("items", "correct", "accuracy", "auroc", "budget_curve")} == \
        {k: whole[k] for k in ("items", "correct", "accuracy", "auroc", "budget_curve")}
    assert "--resume" not in resumed["command"]


def test_resume_refuses_other_settings_other_items_and_an_edited_checkpoint(tmp_path, capsys):
    """Each refusal is one line, before the model is loaded."""
    from decodekit.errors import DecodeKitError
    from decodekit.bench.checkpoint import HEADER, digest

    register_task("fake3", fake_task)
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    assert run(eval_args(tmp_path, "--limit", "2"), model=model) == 0
    path = tmp_path / "checkpoint.json"
    never = lambda: pytest.fail("the model was loaded")  # noqa: E731

    def refused(*argv: str, match: str) -> None:
        with pytest.raises(DecodeKitError, match=match):
            run(eval_args(tmp_path, *argv, "--resume"), model=never)

    refused("--seed", "1", match=r"other settings \(seed\)")
    refused("--max-new-tokens", "3", match=r"other settings \(max_new_tokens\)")
    refused("--numerics", "fast", match=r"other settings \(numerics\)")
    register_task("fake3", lambda: dataclasses.replace(fake_task(), items=[dataclasses.replace(fake_task().items[0], gold="z"),
                                                                          *fake_task().items[1:]]))
    refused(match="the task's items have changed")
    register_task("fake3", lambda: dataclasses.replace(fake_task(), items=[dataclasses.replace(fake_task().items[0], question="abd"),
                                                                          *fake_task().items[1:]]))
    refused(match="the task's items have changed")  # a question edited, its gold kept
    register_task("fake3", fake_task)
    saved = json.loads(path.read_text())
    saved["records"]["1"]["correct"] = not saved["records"]["1"]["correct"]
    path.write_text(json.dumps(saved))
    refused(match="has been changed since decodekit wrote it")
    saved["records"]["1"]["correct"] = not saved["records"]["1"]["correct"]

    def rewritten(match: str) -> None:  # an edit under a digest made for it: the checks past the digest see it
        saved["digest"] = digest({k: v for k, v in saved.items() if k not in HEADER})
        path.write_text(json.dumps(saved))
        refused(match=match)

    # a record moved past the items (just past, and far): each is still checked against its item
    saved["records"]["3"], saved["seconds"]["3"] = saved["records"].pop("1"), saved["seconds"].pop("1")
    rewritten("record '3' is not item 3's")
    saved["records"]["7"], saved["seconds"]["7"] = saved["records"].pop("3"), saved["seconds"].pop("3")
    rewritten("record '7' is not item 7's")
    # two items' records swapped
    saved["records"] = {"0": saved["records"]["7"], "1": saved["records"]["0"]}
    saved["seconds"] = {"0": 1.0, "1": 1.0}
    rewritten("record '0' is not item 0's")
    saved["records"] = {"0": saved["records"]["1"], "1": saved["records"]["0"]}  # (in place again)
    for seconds in ({"0": 1.0}, {"0": 1.0, "1": -1.0}, {"0": 1.0, "1": True}, {"0": 1.0, "1": "1"}):
        saved["seconds"] = seconds
        rewritten("records and seconds must be objects of the same items" if len(seconds) == 1 else
                  "item 1's seconds must be a number >= 0")
    saved["seconds"] = {"0": 1.0, "1": 1.0}
    # a field of the wrong type or range under a digest made for it: summed into an accuracy of 2 right
    # out of 1, or a traceback, before
    for key, bad in (("correct", 2), ("correct", "yes"), ("tokens_spent", -1), ("tokens_spent", 1.5),
                     ("signal_tokens", None), ("time_s", float("nan")), ("output", 5), ("answer", 3),
                     ("signals", []), ("signals", {"agreement": "high"}), ("candidates", [{"answer": "a"}])):
        kept = saved["records"]["1"].get(key, "(none)")
        saved["records"]["1"][key] = bad
        rewritten("record '1' has a field of the wrong type or out of range")
        saved["records"]["1"][key] = kept
    saved["records"]["1"].pop("candidates")
    path.write_text("{")
    refused(match="not a JSON file")
    path.unlink()
    refused(match="no checkpoint.json")
    with pytest.raises(DecodeKitError, match="applies to the item tasks"):
        run(eval_args(tmp_path, "--resume").__class__(**{**vars(eval_args(tmp_path, "--resume")), "task": "longctx"}))


def test_resume_refuses_each_other_setting_that_changes_a_record(tmp_path):
    """The sampling temperature, the signals, the constraint and a method's options each change what
    an item's record holds: a checkpoint made with other ones is refused, before the model loads."""
    from decodekit.errors import DecodeKitError

    def constrained() -> Task:
        task = fake_task()
        return dataclasses.replace(task, items=[dataclasses.replace(i, constraint={"regex": "[a-e]{1,3}"}) for i in task.items])

    sampled = ("--method", "self-consistency", "--n", "2", "--temperature", "0.9")
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    never = lambda: pytest.fail("the model was loaded")  # noqa: E731
    register_task("fake3", constrained)
    try:
        assert run(eval_args(tmp_path / "sampled", *sampled, "--limit", "1"), model=model) == 0
        for argv, setting in ((sampled[:4] + ("--temperature", "0.5"), "temperature"),
                              ((*sampled, "--signals", "agreement"), "signals"),
                              ((*sampled, "--unconstrained"), "constrained")):
            with pytest.raises(DecodeKitError, match=rf"other settings \(.*{setting}"):
                run(eval_args(tmp_path / "sampled", *argv, "--limit", "1", "--resume"), model=never)
    finally:
        register_task("fake3", fake_task)
    beam = ("--method", "beam", "--n", "2", "--limit", "1")
    assert run(eval_args(tmp_path / "beam", *beam), model=model) == 0
    with pytest.raises(DecodeKitError, match=r"other settings \(.*options"):
        run(eval_args(tmp_path / "beam", *beam, "--opt", "length_penalty=2", "--resume"), model=never)


def test_a_resumed_run_counts_only_the_saved_items_under_its_limit(tmp_path, capsys):
    """Items 0 and 2 saved, --limit 2: one item is resumed (item 2 lies past the limit), and the
    progress counts to 2 of 2."""
    from decodekit.bench.checkpoint import HEADER, digest

    register_task("fake3", fake_task)
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    assert run(eval_args(tmp_path), model=model) == 0
    path = tmp_path / "checkpoint.json"
    saved = json.loads(path.read_text())
    del saved["records"]["1"], saved["seconds"]["1"]
    saved["digest"] = digest({k: v for k, v in saved.items() if k not in HEADER})
    path.write_text(json.dumps(saved))
    capsys.readouterr()
    assert run(eval_args(tmp_path, "--limit", "2", "--resume"), model=model) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["items"] == 2 and result["resumed_items"] == 1
    err = capsys.readouterr().err
    assert "1 of 2 items done" in err and "[2/2]" in err and "[3/2]" not in err


def test_an_eval_on_ray_times_each_item_from_the_one_before(monkeypatch):
    """A cluster's items run side by side: each is given the wall time since the item before arrived,
    so that their sum is the run's wall time (here on a clock only the arrivals move, one second
    apart), not a sum of times since the start. No cluster: the pool is a stand-in."""
    import contextlib
    from types import SimpleNamespace

    from decodekit.cluster import PoolSettings
    from decodekit.eval import distributed
    from decodekit.eval.runner import EvalConfig

    clock = SimpleNamespace(now=100.0)

    class OneByOne:
        def __init__(self, ray, factory, settings):
            self.descriptions = [{"host": "h", "pid": 1, "threads": 1, "lost": False, "usable_cores": 1,
                                  "platform": "p", "model": "tiny", "done": []}]

        def map(self, units, on_result):
            for key in units:
                clock.now += 1.0
                self.descriptions[0]["done"].append(key)
                on_result(key, {"id": str(key), "output": "a", "answer": "a", "correct": True, "tokens_spent": 1,
                                "signal_tokens": 0, "signals": {}})

        def close(self):
            pass

    monkeypatch.setattr(distributed, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(distributed, "connected", lambda address: contextlib.nullcontext(None))
    monkeypatch.setattr(distributed, "Pool", OneByOne)
    result = distributed.evaluate_on_ray(lambda: None, fake_task(), EvalConfig(), None, PoolSettings(workers=1))
    assert result["items"] == 3 and result["time_s"] == pytest.approx(3.0)


def test_wilson_bounds_stay_inside_0_1_at_all_wrong_and_all_right():
    """At 0/n the lower bound is 0 and at n/n the upper is 1 (exactly, in closed form); rounding
    must not leave them a hair outside [0, 1], where the report would print -0.000."""
    for n in range(1, 60):
        lo, hi = wilson_interval(0, n)
        assert lo == 0.0  # 0 in closed form, not a rounding of it
        assert hi == pytest.approx((Z95 ** 2 / n) / (1 + Z95 ** 2 / n))
        lo, hi = wilson_interval(n, n)
        assert hi == 1.0 and lo == pytest.approx(1 / (1 + Z95 ** 2 / n))
    lo, hi = wilson_interval(0, 21)
    text = markdown({**REPORT_BASE, "correct": 0, "items": 21, "accuracy": 0.0, "ci95": [lo, hi]})
    assert "95% Wilson CI [0.000, 0.155]" in text  # (3.8415/21) / (1 + 3.8415/21) = 0.1546


def test_auroc_averages_the_ranks_of_a_tie_of_three():
    """A tie counts one half however many scores share it: positives 0.5 and 0.9 against negatives
    0.1, 0.5, 0.5 win 1 + 3 pairs and tie 2, so (4 + 2/2) / 6."""
    assert auroc([0.1, 0.5, 0.5, 0.5, 0.9], [False, True, False, False, True]) == pytest.approx(5 / 6)
    assert auroc([0.3, 0.3, 0.3], [True, False, False]) == pytest.approx(0.5)


def test_the_report_shows_an_auroc_of_zero_as_a_figure():
    """An AUROC of 0 (a signal that ranks every wrong answer above every right one) is a result, not
    the n/a of a signal with one class only."""
    text = markdown({**REPORT_BASE, "auroc": {"agreement": 0.0, "phi_first": None}})
    assert "| agreement | higher = confident | 0.000 |" in text
    assert "| phi_first | lower = confident | n/a |" in text


def test_the_budget_curve_table_shows_three_decimals():
    """Accuracies of the budget curve read like the headline accuracy: three decimals."""
    text = markdown({**REPORT_BASE, "budget_curve": [{"samples": 1, "accuracy": 2 / 3}, {"samples": 3, "accuracy": 1 / 3}]})
    assert "| 1 | 0.667 |" in text and "| 3 | 0.333 |" in text


def test_the_low_accuracy_warning_needs_the_upper_bound_strictly_below_the_threshold():
    """The warning is for runs whose 95% upper bound is below 30%; an upper bound of exactly 30% is not."""
    assert "Accuracy is low" not in markdown({**REPORT_BASE, "ci95": [0.1, 0.3]})
    assert "Accuracy is low" in markdown({**REPORT_BASE, "ci95": [0.1, 0.2999]})


def test_a_gsm8k_answer_starts_at_its_last_number(tmp_path):
    """phi_first reads GSM8K's answer at the final number, not at the text's start."""
    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    task = gsm8k_task(data)
    text = "2 and 2 make 4, so the answer is 4."
    assert task.answer_start(text) == len("2 and 2 make 4, so the answer is ")
    assert task.answer_start("no number here") == 0


def test_a_tasks_default_answer_start_is_the_last_number():
    """A registered task that names no answer_start: its answer begins at the last number (auto)."""
    task = Task("t", [Item("0", "q", "7")], answer=lambda t: t, is_correct=lambda t, item: True)
    assert task.answer_start("first 3 then 7.") == len("first 3 then ")
    assert task.answer_start("Paris") == 0


def test_a_capital_lead_in_after_markup_or_quotes_is_skipped_for_the_answer_start():
    from decodekit.eval.tasks import capital_answer_start

    for prefix in ("**", '"', "  ", "- "):
        text = prefix + "The capital of France is Paris."
        assert capital_answer_start(text) == len(prefix + "The capital of France is "), prefix


def test_a_capital_lead_in_without_the_is_dropped_from_the_answer():
    """"Capital of France is Paris" (no "The") leads in as "The capital of France is" does."""
    assert capital_answer("Capital of France is Paris.") == "paris"
    assert capital_answer("Capital city of France is Paris.") == "paris"


def test_a_capital_denied_with_a_curly_apostrophe_is_not_an_answer():
    """Models write "isn’t" with a curly apostrophe as often as "isn't": it denies the name too."""
    item = Item("FR", "", "Paris", "France")
    assert not capital_correct("It isn’t Paris.", item)
    assert not capital_correct("The capital of France isn’t Paris, it is Lyon.", item)
    assert capital_correct("It is Paris.", item)


def test_words_on_two_lines_are_not_one_place_name():
    """A line break ends the name: "Santiago" then a new line beginning "De facto" is Santiago."""
    item = Item("CL", "", "Santiago", "Chile")
    assert capital_correct("Santiago\nDe facto, it is the seat of government.", item)
    assert not capital_correct("Santiago de Cuba", item)


def test_the_last_word_of_the_text_is_not_the_word_before_the_first():
    """The first word has no word before it: a prefix or a negation at the text's end does not reach it."""
    item = Item("FR", "", "Paris", "France")
    assert capital_correct("Paris, a city in the north", item)
    assert capital_correct("Paris, or so I think, not", item)


def test_a_structured_answer_is_judged_by_json_schema_2020_12():
    """The schema is a 2020-12 one: prefixItems constrains the array's first items (draft 7 ignores it)."""
    pytest.importorskip("jsonschema")
    from decodekit.eval.tasks import schema_valid

    item = Item("x", "", json.dumps({"type": "array", "prefixItems": [{"type": "integer"}]}))
    assert schema_valid("[1, \"a\"]", item)
    assert not schema_valid("[\"a\"]", item)
    item = Item("y", "", json.dumps({"type": "object", "dependentRequired": {"a": ["b"]}}))
    assert not schema_valid('{"a": 1}', item) and schema_valid('{"a": 1, "b": 2}', item)


def test_an_items_seed_wraps_inside_the_seed_range():
    from decodekit.eval.runner import ITEM_SEED_SPACING, EvalConfig, item_seed
    from decodekit.samplers.params import SEED_LIMIT

    first = item_seed(EvalConfig(seed=SEED_LIMIT - 1), 0)
    last = item_seed(EvalConfig(seed=SEED_LIMIT - 1), 2**32 - 1)
    assert 0 <= first < SEED_LIMIT and 0 <= last < SEED_LIMIT
    assert last == (first + (2**32 - 1) * ITEM_SEED_SPACING) % SEED_LIMIT  # past 2**64 - 1, wrapped


def test_runs_with_neighbouring_seeds_draw_unrelated_samples():
    """An item's samples take its seed and the ones after it: were the run's seed used as it is,
    --seed 1 would reuse --seed 0's samples shifted by one. Every item's seeds of one run stay
    apart from every item's of a neighbouring run by more than any n."""
    from decodekit.eval.runner import EvalConfig, item_seed
    from decodekit.samplers.params import SEED_LIMIT

    seeds = {run: [item_seed(EvalConfig(seed=run), i) for i in range(50)] for run in range(4)}
    for a in range(4):
        assert len(set(seeds[a])) == 50  # items apart within a run
        for b in range(a + 1, 4):
            gaps = [min((x - y) % SEED_LIMIT, (y - x) % SEED_LIMIT) for x in seeds[a] for y in seeds[b]]
            assert min(gaps) > 2**16


def test_a_capitals_name_spelled_with_unicode_punctuation_is_denied_and_extended_as_in_ascii():
    """A name holding an apostrophe or a dash ("N’Djamena", "Port-au-Prince") is split into the
    same words whichever script's punctuation the answer writes: a denial or a longer place's name
    around it then counts as with ASCII."""
    for gold, country, wrong, right in [
        ("N'Djamena", "Chad", ["Not N’Djamena", "N’Djamena Falls", "not N'Djamena"], ["N’Djamena", "It is N’Djamena."]),
        ("Port-au-Prince", "Haiti", ["not Port–au–Prince", "not Port-au-Prince"], ["Port–au–Prince"]),
        ("Sanaa", "Yemen", ["not Sana’a"], ["Sana’a", "Sanaa"]),
    ]:
        item = Item("x", "", gold, country)
        assert not any(capital_correct(text, item) for text in wrong), gold
        assert all(capital_correct(text, item) for text in right), gold


def test_a_capital_named_inside_its_country_is_answered_by_a_sentence_in_either_order():
    """"Singapore is the capital of Singapore" names the city as "The capital of Singapore is
    Singapore" does: the country is the mention after "of"; without one, every mention is."""
    item = Item("SG", "", "Singapore", "Singapore")
    assert capital_correct("Singapore is the capital of Singapore.", item)
    assert capital_correct("The capital of Singapore is Singapore.", item)
    assert not capital_correct("It is the capital of Singapore.", item)
    assert not capital_correct("Singapore has no capital.", item)
    assert not capital_correct("Singapore is not the capital of Singapore.", item)


def test_a_capital_denied_after_its_name_or_by_neither_is_not_an_answer():
    item = Item("FR", "", "Paris", "France")
    for wrong in ["Neither Paris nor Lyon is the capital; it is Marseille.", "Paris is not the capital; Lyon is.",
                  "Paris isn’t the capital.", "Paris isn't the capital.", "Paris was not the capital."]:
        assert not capital_correct(wrong, item), wrong
    for right in ["Paris is not only the capital but its largest city.", "Paris. It is not Lyon.", "Paris is the capital."]:
        assert capital_correct(right, item), right


def test_saint_and_st_name_the_same_capital():
    """Geonames writes "St. John's" and "Saint Helier": either spelling of the first word counts."""
    for gold, country, answers in [("St. John's", "Antigua and Barbuda", ["Saint John's", "St John's", "St. John's"]),
                                   ("Saint Helier", "Jersey", ["St. Helier", "St Helier", "Saint Helier"]),
                                   ("Saint-Denis", "Reunion", ["St-Denis", "Saint Denis"])]:
        item = Item("x", "", gold, country)
        assert all(capital_correct(a, item) for a in answers), gold
    assert not capital_correct("Stockholm", Item("x", "", "St. John's", "Antigua and Barbuda"))


def test_a_capital_lead_in_with_a_curly_apostrophe_is_found():
    from decodekit.eval.tasks import capital_answer_start

    assert capital_answer_start("France’s capital is Paris.") == capital_answer_start("France's capital is Paris.") == 20


def test_a_structured_answer_must_be_strict_json():
    """Python's json module reads NaN, Infinity and a key given twice: none of them is JSON."""
    from decodekit.eval.tasks import schema_valid

    item = Item("x", "", json.dumps({"type": "object"}))
    for text in ['{"foo": NaN}', '{"foo": Infinity}', '{"foo": -Infinity}', "NaN", '{"foo": 1, "foo": 2}']:
        assert not schema_valid(text, Item("x", "", json.dumps({})) if text == "NaN" else item), text
    assert schema_valid('{"foo": 1, "bar": {"foo": 2}}', item)
    assert schema_valid('{"foo": ' + "9" * 5000 + "}", item)  # past Python's digits for int(): still JSON


def test_the_budget_curve_judges_the_winner_among_the_first_m_samples_only():
    """At m samples the vote and its correctness read those m alone: a later sample with the same
    answer, judged right, does not make the first sample's vote right."""
    records = [{"candidates": [{"answer": "x", "correct": False}, {"answer": "x", "correct": True}]}]
    assert budget_curve(records) == [{"samples": 1, "accuracy": 0.0}, {"samples": 2, "accuracy": 1.0}]


def test_extra_signals_are_drawn_with_the_ns_and_paraphrases_asked(monkeypatch):
    """--signals agreement draws --n samples; --signals pc asks for --paraphrases rephrasings."""
    import decodekit.eval.runner as runner

    seen = []
    monkeypatch.setattr(runner, "sampled_agreement",
                        lambda *a, n=8, **kw: seen.append(("n", n)) or {"agreement": 1.0, "tokens_spent": 0})
    monkeypatch.setattr(runner, "paraphrase_consistency",
                        lambda model, prompts, *a, **kw: seen.append(("k", len(prompts))) or {"pc": 1.0, "tokens_spent": 0})
    scripted_eval(monkeypatch, ScriptedDecoder(lambda prompt: ("a", {}, {})), n=3, signals=["agreement", "pc"],
                  paraphrases=2)
    assert seen == [("n", 3), ("k", 2)] * 3


def test_results_options_leave_out_python_callables():
    """A callable given as an option (answer=) is no JSON: the summary's options keep the rest."""
    from decodekit.eval.runner import EvalConfig, summarize

    config = EvalConfig(method="self-consistency", options={"answer": lambda t: t, "temperature": 0.5})
    result = summarize(fake_task(), config, [], 0.0)
    assert result["options"] == {"temperature": 0.5}
    json.dumps(result)


@pytest.mark.parametrize("method", ["greedy", "cot", "self-consistency"])
def test_every_method_reads_the_tasks_answer_start(method):
    """phi_first is read where the task says its answer begins, for the plain methods too."""
    from decodekit.eval.runner import EvalConfig, evaluate

    task = fake_task()
    seen = []
    task.answer_start = lambda text: seen.append(text) or 0
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    n = 8 if method == "greedy" else 2
    evaluate(model, task, EvalConfig(method=method, n=n, max_new_tokens=3, limit=1))
    assert seen
