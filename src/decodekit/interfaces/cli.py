"""The ``decodekit`` command line: generate, chat, models, methods, bench, eval."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from ..errors import DecodeKitError, InvalidParameter

# Sampler flags: name -> type. The names are Sampler.from_params' keywords.
SAMPLER_FLAGS: dict[str, type] = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "typical_p": float,
    "epsilon": float,
    "eta": float,
    "top_n_sigma": float,
    "top_h": float,
    "adaptive_k": float,
    "repetition_penalty": float,
    "frequency_penalty": float,
    "presence_penalty": float,
    "penalty_window": int,
    "no_repeat_ngram_size": int,
    "seed": int,
}

# Subcommands that live with their feature: module exposing add_parser(subparsers).
PLUGIN_COMMANDS = ("decodekit.bench.cli", "decodekit.eval.cli")


def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as bool, int, float or string."""
    if "=" not in text:
        raise InvalidParameter(f"--opt expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    for cast in (int, float):
        try:
            return key, cast(raw)
        except ValueError:
            pass
    return key, raw


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="embedded model name, HF model folder or .gguf file (default: smollm2-135m)")
    parser.add_argument("--backend", default="auto", choices=["auto", "native", "hf"], help="model backend (default: native for Llama-family)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and compute dtype")


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="greedy", help="decoding method (see `decodekit methods`; default greedy)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--draft-model", default=None, help="draft model for --method draft")
    parser.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="method option (repeatable), e.g. --opt max_ngram=3")
    group = parser.add_argument_group("sampling (any of these with a positive temperature samples)")
    for name, kind in SAMPLER_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None)


def decoding_params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {name: getattr(args, name) for name in SAMPLER_FLAGS if getattr(args, name) is not None}
    params.update(parse_option(o) for o in args.opt)
    if args.draft_model is not None:
        params["draft_model"] = args.draft_model
    return params


def validate_decoding(args: argparse.Namespace) -> None:
    """Reject a bad method, sampler value or option before the model is loaded."""
    from ..engine import build_decoder, make_sampler, split_params

    if args.max_new_tokens < 1:
        raise InvalidParameter(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    sampler_params, options = split_params(decoding_params(args))
    make_sampler(args.method, sampler_params)
    build_decoder(args.method, **options)


def make_engine(args: argparse.Namespace):
    from ..engine import Engine

    return Engine(args.model, backend=args.backend, dtype=args.dtype)


def read_prompt(prompt: str | None) -> str:
    if prompt not in (None, "-"):
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise InvalidParameter("no prompt: give one as an argument or on standard input")
    text = sys.stdin.read().strip()
    if not text:
        raise InvalidParameter("the prompt on standard input is empty")
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    validate_decoding(args)
    prompt = read_prompt(args.prompt)
    engine = make_engine(args)
    stream = args.stream and not args.json

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
        **decoding_params(args),
    )
    if args.json:
        print(json.dumps(result.as_dict(), ensure_ascii=False))
    elif stream:
        print()
    else:
        print(result.text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    validate_decoding(args)
    engine = make_engine(args)
    params = decoding_params(args)
    messages: list[dict[str, str]] = []
    print(f"decodekit chat · {engine.model.name} · {args.method} · empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        result = engine.generate(
            messages, method=args.method, max_new_tokens=args.max_new_tokens, stop=args.stop,
            on_text=lambda d: (sys.stdout.write(d), sys.stdout.flush()), **params,
        )
        print(f"\n  [{result.stats.new_tokens} tokens, {result.stats.tokens_per_s:.1f} tok/s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from ..models.loading import DEFAULT_MODEL, EMBEDDED_MODELS, cache_root, embedded_gguf

    print("Embedded models (pip packages carrying a GGUF file):")
    for name, model in EMBEDDED_MODELS.items():
        path = embedded_gguf(name)
        status = f"installed: {path}" if path else f"not installed ({model.install})"
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"  {name}{default}: {model.description}\n      {status}")
    print(f"Dequantised weights are cached in {cache_root()} (override with DECODEKIT_CACHE).")
    print("--model also accepts a Hugging Face model folder or a .gguf file.")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from ..engine import available_methods

    for name, spec in sorted(available_methods().items(), key=lambda kv: (kv[1].family, kv[0])):
        kind = "lossless" if spec.lossless else "changes output"
        print(f"  {name:<18} {spec.family:<12} {kind:<15} {spec.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decodekit", description="The decoding layer for language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read standard input)")
    add_model_arguments(gen)
    add_decoding_arguments(gen)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming")
    add_model_arguments(chat)
    add_decoding_arguments(chat)
    chat.set_defaults(func=cmd_chat)

    sub.add_parser("models", help="list the models decodekit can load").set_defaults(func=cmd_models)
    sub.add_parser("methods", help="list the decoding methods").set_defaults(func=cmd_methods)

    for module in PLUGIN_COMMANDS:
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DecodeKitError as err:
        print(f"decodekit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ndecodekit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
