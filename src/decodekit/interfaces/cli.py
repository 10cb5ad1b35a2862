"""The ``decodekit`` command line: generate, chat, models, methods, bench, profile, eval, serve, bench-serve,
train-drafter, cache."""

from __future__ import annotations

import argparse
import codecs
import errno
import json
import os
import sys
from collections.abc import Collection
from importlib import import_module
from pathlib import Path
from typing import Any

from ..arguments import ArgumentParser, add_model_arguments, check_argv, user_path
from ..errors import DecodeKitError, InvalidParameter, PromptTooLong
from ..options import OptionSpec, parse_option_items
from ..samplers.params import SAMPLER_OPTIONS

#: One flag per sampler parameter, from the sampler's table (``greedy`` is ``--method greedy``).
SAMPLER_FLAGS: dict[str, OptionSpec] = {name: spec for name, spec in SAMPLER_OPTIONS.items() if name != "greedy"}

#: Subcommands that live with their feature: each module has ``add_arguments(parser)``, which
#: also sets the function that runs the command. A module is imported only where its command is
#: the one given (or where every command's parser is asked for), so ``decodekit --help`` and a
#: mistyped command answer without importing torch.
PLUGIN_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("decodekit.bench.cli", "Spec-Bench-style speed benchmark of decoding methods and baselines"),
    "profile": ("decodekit.bench.profile", "pass costs, prefill speed and the machine's limits"),
    "eval": ("decodekit.eval.cli", "evaluate a decoding method on a task (gsm8k, capitals, structured, longctx)"),
    "serve": ("decodekit.serve.cli", "an OpenAI-compatible server with continuous batching"),
    "bench-serve": ("decodekit.serve.load",
                    "replay Spec-Bench questions against an OpenAI-compatible server at several concurrency levels"),
    "train-drafter": ("decodekit.speculative.trained.cli", "train an EAGLE, Medusa or Hydra drafter on the model's own outputs"),
    "cache": ("decodekit.interfaces.cache_command", "what decodekit keeps on disk, and removing what has gone unused"),
}

#: What leaves ``decodekit chat`` (besides Ctrl-D).
CHAT_EXIT = ("/exit", "/quit", "exit", "quit")


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="greedy", help="decoding method (see `decodekit methods`; default greedy)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--draft-model", default=None, help="draft model for --method draft")
    parser.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="method option (repeatable), e.g. --opt max_ngram=3")
    group = parser.add_argument_group(
        "sampling", "greedy never samples (a positive --temperature or a truncation such as --top-p is an error: use "
        "--method sample); sample always does; speculative methods sample when --temperature is given, else decode "
        "greedily (and refuse truncations likewise); beam and cot "
        "never sample; the search methods that choose among samples draw them at --temperature, or at their "
        "sample_temperature option where it is not given or 0")
    for name, spec in SAMPLER_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=spec.type, default=None,
                           metavar=spec.type.__name__.upper(), help=spec.help)
    structured = parser.add_argument_group("structured output (one of these; any method)").add_mutually_exclusive_group()
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--json-schema", metavar="FILE|JSON", help="the output is JSON valid against this schema")
    structured.add_argument("--regex", metavar="RE", help="the whole output matches this regular expression")
    structured.add_argument("--choice", metavar="A,B,C", help="the output is one of these comma-separated strings")
    structured.add_argument("--grammar", metavar="FILE", help="the output follows this Lark grammar (as llguidance reads it)")


def exists_as(path: Path, kind: str = "file") -> bool:
    """Whether ``path`` is a folder (the kind ``"folder"``) or something to read as a file (anything
    else that exists: a pipe too, as ``<(...)`` gives), false where the system refuses the name
    (longer than a file name may be: an inline JSON schema of more than 255 characters), which
    would otherwise be an OSError."""
    try:
        return path.is_dir() if kind == "folder" else path.exists() and not path.is_dir()
    except OSError:
        return False


def constraint_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The structured-output flag as a constraint (``--json-schema`` and ``--grammar`` read a file
    when given one), checked now: a bad schema, pattern or grammar is one line before any model loads."""
    from ..samplers.constraint import checked_grammar

    def text_or_file(value: str, flag: str) -> str:
        path = user_path(value)
        if exists_as(path, "folder"):
            raise InvalidParameter(f"{flag} {value!r} is a folder: give a file")
        if len(value) < 4096 and exists_as(path):
            try:
                return path.read_text(encoding="utf-8-sig")  # (a byte-order mark some editors write, dropped)
            except (OSError, UnicodeDecodeError) as err:
                raise InvalidParameter(f"cannot read {value}: {err}") from None
        if not (value.lstrip().startswith(("{", "[")) or value.strip() in ("true", "false")):  # meant as a file
            raise InvalidParameter(f"{flag} {value!r}: no such file (give a file or the schema as JSON text)")
        return value

    if args.json_object:
        spec = {"json": None}
    elif args.json_schema is not None:
        spec = {"json_schema": text_or_file(args.json_schema, "--json-schema")}
    elif args.regex is not None:
        spec = {"regex": args.regex}
    elif args.choice is not None:
        choices = args.choice.split(",")
        if "" in choices:  # refused, not dropped, as the server refuses one: the user may have meant another choice
            raise InvalidParameter(f"--choice {args.choice!r}: a choice is empty (a doubled, leading or trailing "
                                   "comma); give comma-separated non-empty strings")
        spec = {"choice": choices}
    elif args.grammar is not None:
        if not exists_as(user_path(args.grammar)) and not exists_as(user_path(args.grammar), "folder"):
            raise InvalidParameter(f"--grammar: no such file {args.grammar!r}")
        spec = {"grammar": text_or_file(args.grammar, "--grammar")}
    else:
        return None
    checked_grammar(spec)
    return spec


def decoding_params(args: argparse.Namespace) -> dict[str, Any]:
    """Sampler flags and ``--opt`` method options (parsed by the method's option specs) as keywords."""
    from ..engine import method_spec

    params: dict[str, Any] = {name: getattr(args, name) for name in SAMPLER_FLAGS if getattr(args, name) is not None}
    options = method_spec(args.method).options
    # a sampler parameter given as --opt is read as its flag reads it; greedy decoding is a method
    given = parse_option_items(args.opt, {**SAMPLER_FLAGS, **(options or {})})  # (twice: refused there)
    if "greedy" in given:
        raise InvalidParameter("--opt greedy=...: greedy decoding is a method (--method greedy), not a sampler option")
    for key, value in given.items():
        if key in params:  # never one value silently over another
            raise InvalidParameter(f"--{key.replace('_', '-')} and --opt {key}=... both set {key}; give one")
        params[key] = value
    if args.draft_model is not None:
        if "draft_model" not in (options or {}):
            raise InvalidParameter(f"--draft-model goes with --method draft; method {args.method!r} takes no draft model")
        if "draft_model" in params:
            raise InvalidParameter("--draft-model and --opt draft_model=... both name the draft model; give one")
        params["draft_model"] = args.draft_model
    return params


def validate_decoding(args: argparse.Namespace) -> dict[str, Any] | None:
    """Reject a bad method, sampler value, option or constraint before the model is loaded; return
    the structured-output constraint, if any (:func:`constraint_from_args`)."""
    from ..engine import build_decoder, check_model_cache, make_sampler, method_spec, split_params, stop_strings

    method_spec(args.method)
    if args.max_new_tokens < 1:
        raise InvalidParameter(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    stop_strings(args.stop)  # the engine's check, before the model loads
    sampler_params, options = split_params(decoding_params(args))
    make_sampler(args.method, sampler_params)
    check_model_cache(args.method, options, build_decoder(args.method, **options), args.kv_cache)
    return constraint_from_args(args)


def make_engine(args: argparse.Namespace):
    from ..engine import Engine

    return Engine(args.model, backend=args.backend, dtype=args.dtype, numerics=args.numerics, kv_cache=args.kv_cache)


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush of what could not be
    written does not fail again."""
    if sys.stdout is None:  # closed from the start: nothing to flush
        return
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


#: Standard input past this many bytes is refused, read no further: more text than any model's context
#: holds (ten million tokens at four bytes a token is 40 MB), and input without end would fill the memory.
MAX_STDIN_BYTES = 64 << 20


def read_prompt(prompt: str | None) -> str:
    """The prompt argument, or standard input for none or ``-`` (which must be UTF-8 text), less its
    final newlines, as ``"$(cat file)"`` gives it: a code prompt keeps its leading indentation."""
    from ..engine.api import check_prompt_text  # (the API's check: empty or only whitespace)

    if prompt not in (None, "-"):
        return check_prompt_text(prompt)
    if sys.stdin is None or sys.stdin.isatty():
        raise InvalidParameter("no prompt: give one as an argument or on standard input")
    if hasattr(sys.stdin, "buffer"):
        data = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1)
        if len(data) > MAX_STDIN_BYTES:
            raise InvalidParameter(f"standard input holds more than {MAX_STDIN_BYTES >> 20} MiB: more text than a "
                                   "model's context window holds")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidParameter(f"standard input is not valid UTF-8 (byte {data[err.start]:#04x} at offset {err.start})") from None
    else:  # already text (a StringIO in tests)
        text = sys.stdin.read()
    return check_prompt_text(text.rstrip("\r\n"), "the prompt on standard input")


def cmd_generate(args: argparse.Namespace) -> int:
    constraint = validate_decoding(args)
    prompt = read_prompt(args.prompt)
    engine = make_engine(args)
    stream = args.stream

    def emit(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    result = engine.generate(
        prompt,
        method=args.method,
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        chat=not args.raw,
        on_text=emit if stream else None,
        constraint=constraint,
        **decoding_params(args),
    )
    if args.json:  # escaped where standard output's encoding is not UTF-8: machine-readable, nothing lost
        print(json.dumps(result.as_dict(), ensure_ascii=not writes_utf8(sys.stdout)))
    elif stream:
        print()
    else:
        print(result.text)
    if constraint is not None and result.finish_reason == "length" and not args.json:  # (--json says so itself)
        print(f"decodekit: the answer stopped at --max-new-tokens {args.max_new_tokens} before its constraint was met: "
              "it is not a whole match", file=sys.stderr)
    return 0


def answer_within_context(engine, messages: list[dict[str, str]], **kwargs: Any):
    """(the answer to the last message, the messages it was given): the oldest exchanges left out
    as far as the model's context needs, or (None, ...) with one line on stderr where the last
    message alone does not fit. Nothing is printed before a prompt is found to fit."""
    sent = messages
    while True:
        try:
            return engine.generate(sent, **kwargs), sent
        except PromptTooLong as err:
            if len(sent) == 1:
                print(f"decodekit: {err}; not sent", file=sys.stderr)
                return None, sent
            sent = sent[2:]  # without the oldest exchange (a user message and its answer)


def check_room_for_a_message(engine, max_new_tokens: int) -> None:
    """Refuse, before the first message, an answer length that leaves no room in the model's context
    for even a one-character message (every message would be refused, one by one)."""
    from ..engine.api import prompt_token_ids

    limit = engine.model.backend.info.max_length
    shortest = len(prompt_token_ids(engine.model, [{"role": "user", "content": "x"}], chat=True))
    if shortest + max_new_tokens > limit:
        raise InvalidParameter(f"--max-new-tokens {max_new_tokens} leaves no room for a message in the model's "
                               f"context of {limit} tokens (a message and its answer must fit; the shortest takes "
                               f"{shortest} tokens)")


def read_chat_line() -> str | None:
    """The next line of standard input, None at its end. Its bytes are read as UTF-8 whatever the
    locale or PYTHONIOENCODING says (as ``generate`` reads its prompt), one line at a time, so a line
    that is not UTF-8 (a UnicodeError) loses that line alone, and so does a line past
    :data:`MAX_STDIN_BYTES` (an InvalidParameter, once the rest of it is read and dropped). A text
    stream without bytes (a test's) is taken as it is, a lone surrogate in it standing for a byte
    that was not UTF-8."""
    stream = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else sys.stdin
    raw = stream.readline(MAX_STDIN_BYTES + 2)  # the cap, one more, and the line's end
    if not raw:
        return None
    line_end = b"\n" if isinstance(raw, bytes) else "\n"
    if len(raw) - raw.endswith(line_end) > MAX_STDIN_BYTES:
        while raw and not raw.endswith(line_end):  # the rest of the line
            raw = stream.readline(1 << 20)
        raise InvalidParameter(f"the line is more than {MAX_STDIN_BYTES >> 20} MiB: more text than a model's "
                               "context window holds")
    line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    line.encode("utf-8")  # a lone surrogate: UnicodeEncodeError
    return line


def cmd_chat(args: argparse.Namespace) -> int:
    constraint = validate_decoding(args)
    if sys.stdin is None:  # started with it closed (`<&-`): no message can come
        raise InvalidParameter("standard input is closed: chat reads its messages there")
    engine = make_engine(args)
    params = decoding_params(args)
    check_room_for_a_message(engine, args.max_new_tokens)
    messages: list[dict[str, str]] = []
    print(f"decodekit chat · {engine.model.name} · {args.method} · /exit, /quit or Ctrl-D to leave, "
          "Ctrl-C to stop an answer", file=sys.stderr)
    # a prompt for a person at a terminal, on stderr: stdout holds the answers alone
    prompt = "> " if sys.stdin.isatty() else ""
    while True:
        print(prompt, end="", file=sys.stderr, flush=True)
        try:
            line = read_chat_line()
        except UnicodeError:  # that line only: the conversation goes on
            print("decodekit: the line is not valid UTF-8; not sent", file=sys.stderr)
            continue
        except InvalidParameter as err:  # (a line too long to read)
            print(f"decodekit: {err}; not sent", file=sys.stderr)
            continue
        if line is None:  # the end of input (Ctrl-D)
            if prompt:
                print(file=sys.stderr)  # the prompt's line ends
            break
        line = line.strip()
        if not line:  # nothing to send
            continue
        if line.lower() in CHAT_EXIT:
            break
        messages.append({"role": "user", "content": line})
        try:
            result, sent = answer_within_context(
                engine, messages, method=args.method, max_new_tokens=args.max_new_tokens, stop=args.stop,
                on_text=lambda d: (sys.stdout.write(d), sys.stdout.flush()), constraint=constraint, **params,
            )
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the chat (at the prompt it leaves)
            print(flush=True)  # the cut answer's line ends
            print("  [stopped: this message and its answer are not kept]", file=sys.stderr)
            messages.pop()
            continue
        if result is None:  # the message alone does not fit: the history stays as it was
            messages.pop()
            continue
        print(flush=True)  # the answer's line ends where it was written, so that a saved stdout reads answer by answer
        if len(sent) < len(messages):
            dropped = (len(messages) - len(sent)) // 2
            print(f"  [the oldest {dropped} exchange(s) dropped to fit the model's context]", file=sys.stderr)
        print(f"  [{result.stats.new_tokens} tokens, {result.stats.tokens_per_s:.1f} tok/s]", file=sys.stderr)
        messages = [*sent, {"role": "assistant", "content": result.text}]
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from ..models.cache import cache_root
    from ..models.loading import DEFAULT_MODEL, EMBEDDED_MODELS, assembled_target, embedded_gguf

    print("Embedded models (pip packages carrying a GGUF file):")
    for name, model in EMBEDDED_MODELS.items():
        # a model shipped in chunks is listed, not assembled (hundreds of megabytes written by a listing)
        path = assembled_target(name) if model.assembled else embedded_gguf(name)
        status = (f"not installed ({model.install})" if path is None else f"installed: {path}" if path.is_file()
                  else "installed (its file is assembled into the cache at first use)")
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"  {name}{default}: {model.description}\n      {status}")
    print(f"Dequantised weights are cached in {cache_root()} (override with DECODEKIT_CACHE).")
    print("--model also accepts a Hugging Face model folder or a .gguf file.")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from ..engine import available_methods
    from ..models.kv_policy import POLICY_HELP

    for name, spec in sorted(available_methods().items(), key=lambda kv: (kv[1].family, kv[0])):
        kind = "lossless" if spec.lossless else "changes output"
        print(f"  {name:<18} {spec.family:<12} {kind:<15} {spec.description}")
        if spec.options is None:
            print("      options: not declared")
        for option in (spec.options or {}).values():
            print(f"      {option.describe()}")
    print("Set an option with --opt key=value (bench: --opt method.key=value); every method also takes the "
          "sampling flags of `decodekit generate --help`.")
    print("KV cache policies (--kv-cache POLICY; kv_cache= on decodekit.Engine or decodekit.generate in Python). Every "
          "policy but full changes the output and holds one sequence: methods that decode several at once (beam, "
          "best-of-n, ...) need full:")
    for spelling, description in POLICY_HELP.items():
        print(f"--kv-cache {spelling:<36} {description}")
    return 0


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; with ``commands``, the feature commands (:data:`PLUGIN_COMMANDS`)
    among them get their arguments and the rest only their name and help (their modules are not
    imported)."""
    parser = ArgumentParser(prog="decodekit", description="The decoding layer for language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read standard input)")
    add_model_arguments(gen)
    add_decoding_arguments(gen)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template: continue the prompt's text")
    output = gen.add_mutually_exclusive_group()  # one JSON object is printed at the end: nothing to stream
    output.add_argument("--stream", action="store_true", help="print text as it is generated")
    output.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming")
    add_model_arguments(chat)
    add_decoding_arguments(chat)
    chat.set_defaults(func=cmd_chat)

    sub.add_parser("models", help="list the models decodekit can load").set_defaults(func=cmd_models)
    sub.add_parser("methods", help="list the decoding methods").set_defaults(func=cmd_methods)

    for name, (module, help_line) in PLUGIN_COMMANDS.items():
        command = sub.add_parser(name, help=help_line)
        if commands is None or name in commands:
            import_module(module).add_arguments(command)
    return parser


def writes_utf8(stream) -> bool:
    """Whether ``stream`` encodes its text as UTF-8."""
    try:
        return codecs.lookup(getattr(stream, "encoding", None) or "ascii").name == "utf-8"
    except LookupError:
        return False


def tolerate_unencodable_output() -> None:
    """Text that standard output's encoding cannot hold (a model's emoji, an option's Δ, under a
    Latin-1 locale or ``PYTHONIOENCODING=ascii``) is written as '?' instead of ending the command
    in a UnicodeEncodeError traceback (standard error already escapes it)."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="replace")
        except (ValueError, OSError):  # a stream closed or detached: nothing will be written to it
            pass


def main(argv: list[str] | None = None) -> int:
    """Run one command; every bad input ends in one line on stderr and exit code 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if sys.stderr is None:  # started with it closed (`2>&-`): messages go nowhere, not into stdout (print's default)
        sys.stderr = open(os.devnull, "w")
    tolerate_unencodable_output()
    try:
        check_argv(argv)
        args = build_parser(commands=argv[:1]).parse_args(argv)  # the command comes first
        if sys.stdout is None and args.command != "serve":  # started with it closed (`>&-`): the answer would be lost
            raise OSError(errno.EBADF, "standard output is closed")
        status = args.func(args)
        if sys.stdout is not None:  # (serve may run with it closed)
            sys.stdout.flush()  # a reader that left shows up here, where it is handled
        return status
    except DecodeKitError as err:
        print(f"decodekit: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader left (`decodekit generate --stream ... | head -c 5`): stop quietly with the
        # status of a process ended by SIGPIPE.
        silence_stdout()
        return 128 + 13
    except OSError as err:  # the output could not be written (a full disk: `> /dev/full`), or a file read
        silence_stdout()
        print(f"decodekit: error: {err.strerror or err}" + (f": {err.filename}" if err.filename else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ndecodekit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
