"""The command line: bad input gives one line and a non-zero exit; the real model answers."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from decodekit.errors import InvalidParameter
from decodekit.interfaces.cli import main
from decodekit.options import parse_option


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "decodekit", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--method", "nope"], "unknown method 'nope'"),
        (["generate", "hi", "--method", "sample", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "hi", "--model", "/no/such/model"], "not found"),
        (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
        (["generate", "hi", "--opt", "novalue"], "key=value"),
        # one value never silently over another; a blank name names no model; --workers only with --ray
        (["generate", "hi", "--method", "sample", "--temperature", "0.5", "--opt", "temperature=0.7"],
         "--temperature and --opt temperature=... both set temperature"),
        (["generate", "hi", "--model", " "], "is empty"),
        (["bench", "--workers", "2"], "--workers needs --ray"),
        (["bench", "--workers", "0"], "--workers must be an integer >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_parse_option_types():
    assert parse_option("a=3") == ("a", 3)
    assert parse_option("b=0.5") == ("b", 0.5)
    assert parse_option("c=true") == ("c", True)
    assert parse_option("d=x=y") == ("d", "x=y")


def test_methods_lists_greedy(capsys):
    assert main(["methods"]) == 0
    assert "greedy" in capsys.readouterr().out


@pytest.mark.real_model
def test_generate_answers_on_the_embedded_model(real_model, capsys):
    # in this process (the JSON test below starts the command in a process of its own)
    assert main(["generate", "What is the capital of France?", "--max-new-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out


@pytest.mark.real_model
def test_json_output_from_stdin_and_seeded_sampling_across_processes_and_methods(real_model):
    """One command-line run (pld sampling, the prompt from stdin, JSON out) and the same request in
    this process with sample, pld and suffix: the seed and the position fix each token, whatever the
    method and whichever process draws it."""
    from decodekit.engine import Engine

    prompt, params = "Tell a short story about a fox.", {"temperature": 0.8, "seed": 7, "max_new_tokens": 40}
    out = run_cli("generate", "--method", "pld", "--temperature", "0.8", "--seed", "7", "--max-new-tokens", "40",
                  "--json", stdin=prompt)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert set(record) >= {"text", "tokens", "stats"}
    assert set(record["stats"]) >= {"prefill_s", "decode_s", "new_tokens", "forward_passes", "tokens_per_s"}
    assert record["stats"]["new_tokens"] == len(record["tokens"]) <= 40
    assert record["text"] == real_model.tokenizer.decode(record["tokens"]) and record["text"]
    engine = Engine(real_model)
    assert all(engine.generate(prompt, method=m, **params).tokens == record["tokens"] for m in ("sample", "pld", "suffix"))


@pytest.mark.real_model
def test_prompt_longer_than_context_is_a_clear_error(real_model, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("word " * 9000).encode())))
    assert main(["generate", "--raw", "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_output_the_terminals_encoding_cannot_hold_is_replaced_not_a_traceback(monkeypatch):
    """`decodekit methods` prints an option's Δ: under an ASCII or Latin-1 standard output it is a '?'."""
    import io

    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii")
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["methods"]) == 0
    out.flush()
    text = raw.getvalue().decode("ascii")
    assert "sum ? over paths with the same answer" in text


def test_every_sampler_parameter_has_a_flag():
    from decodekit.interfaces.cli import SAMPLER_FLAGS
    from decodekit.samplers import SAMPLER_PARAMS

    # `greedy` is spelled `--method greedy` on the command line
    assert set(SAMPLER_FLAGS) == set(SAMPLER_PARAMS) - {"greedy"}


def test_a_prompt_on_standard_input_keeps_its_indentation(monkeypatch):
    """Standard input loses its final newlines only, as "$(cat file)" does: the same prompt as the argument."""
    import io

    from decodekit.interfaces.cli import read_prompt

    monkeypatch.setattr(sys, "stdin", io.StringIO("    def add(a, b):\n\n"))
    assert read_prompt(None) == "    def add(a, b):" == read_prompt("    def add(a, b):")
    monkeypatch.setattr(sys, "stdin", io.StringIO(" \n\n"))
    with pytest.raises(InvalidParameter, match="empty"):
        read_prompt("-")


def test_a_prompt_on_standard_input_loses_a_final_windows_line_end(monkeypatch):
    """A prompt file saved with CRLF line ends loses the whole final line end, as a LF one does: the
    model is not asked to continue a stray carriage return."""
    import io

    from decodekit.interfaces.cli import read_prompt

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"first line\r\nsecond line\r\n")))
    assert read_prompt(None) == "first line\r\nsecond line"


def test_the_model_flags_reach_the_engine(monkeypatch):
    """--model, --backend, --dtype, --numerics and --kv-cache are all given to the Engine."""
    from decodekit import engine
    from decodekit.interfaces.cli import build_parser, make_engine

    made = []
    monkeypatch.setattr(engine, "Engine", lambda model, **kwargs: made.append((model, kwargs)))
    args = build_parser(commands=["generate"]).parse_args(
        ["generate", "hi", "--model", "m.gguf", "--backend", "hf", "--dtype", "bfloat16", "--numerics", "fast",
         "--kv-cache", "int8"])
    make_engine(args)
    assert made == [("m.gguf", {"backend": "hf", "dtype": "bfloat16", "numerics": "fast", "kv_cache": "int8"})]


def test_choice_flag_refuses_empty_alternatives_quoting_what_was_given():
    """--choice a,,b is refused, not run as the choices a and b: an empty choice (a doubled, leading or
    trailing comma) would let the model answer nothing, and dropping it would run something other than
    what was asked (the server refuses an empty choice too). The line quotes the flag's text."""
    import argparse

    from decodekit.interfaces.cli import constraint_from_args

    def choice(text: str):
        return constraint_from_args(argparse.Namespace(json_object=False, json_schema=None, regex=None, choice=text,
                                                       grammar=None))

    assert choice("yes,no") == {"choice": ["yes", "no"]}
    for text in ("yes,,no", "yes,no,", ",yes", ",", ""):
        with pytest.raises(InvalidParameter, match=f"^--choice {re.escape(repr(text))}: a choice is empty"):
            choice(text)


def test_generate_and_chat_flags_default_to_what_the_readme_says():
    """README: greedy is the default method, float32 on the exact numerics, a full KV cache, the backend
    chosen by the model (auto); the embedded model where --model is not given."""
    from decodekit.interfaces.cli import build_parser

    for argv in (["generate", "hi"], ["chat"]):
        args = build_parser(commands=argv[:1]).parse_args(argv)
        assert (args.method, args.numerics, args.dtype, args.kv_cache, args.backend, args.model) == (
            "greedy", "exact", "float32", "full", "auto", None)
        assert args.stop == [] and args.opt == [] and args.draft_model is None


def test_ctrl_c_ends_with_status_130_and_one_line(monkeypatch, capsys):
    """An interrupted command exits as a process ended by SIGINT does (128 + 2), with one line on
    stderr and no traceback."""
    from decodekit.interfaces import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_methods", interrupted)
    assert main(["methods"]) == 130
    assert capsys.readouterr().err.strip() == "decodekit: interrupted"


def test_methods_says_which_methods_keep_the_output(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  greedy +plain +lossless +plain greedy decoding$", out, re.M), out
    assert re.search(r"^  beam +search +changes output +beam search", out, re.M), out
