"""``decodekit bench``: run the benchmark, write results.json / report.md / speedup.png, or compare two runs."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..arguments import (add_model_argument, add_numerics_arguments, add_ray_arguments, check_ray_arguments, check_writable,
                         flags_given, named)
from ..errors import DecodeKitError, InvalidParameter
from ..options import check_int, parse_option_items
from .questions import DEFAULT_QUESTIONS

if TYPE_CHECKING:
    from .execution import Plan

#: --quick: the fast model-free speculative methods, when registered (skipped with a note otherwise).
QUICK_METHODS = ("greedy", "pld", "suffix", "recycling", "lookahead")
QUICK = {"limit": 1, "max_new_tokens": 64, "baselines": "hf", "repeats": 5}  # short runs: medians of 5 resist stalls
FULL = {"limit": None, "max_new_tokens": 256, "baselines": "hf,hf-pld,llamacpp", "repeats": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Benchmark decoding methods against decodekit greedy, transformers generate() and llama.cpp "
                     "on Spec-Bench questions. Writes DIR/results.json, DIR/report.md and DIR/speedup.png.")
    p.add_argument("--questions", default=None, metavar="FILE", help=f"Spec-Bench JSONL file (default {DEFAULT_QUESTIONS})")
    p.add_argument("--methods", default=None, help="comma-separated decodekit methods (greedy is always included; "
                   "default: greedy + every registered speculative method)")
    p.add_argument("--baselines", default=None, help="comma-separated from hf, hf-pld, llamacpp, or 'none' "
                   f"(default {FULL['baselines']}; --quick: {QUICK['baselines']})")
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"per turn (default {FULL['max_new_tokens']}; --quick {QUICK['max_new_tokens']})")
    p.add_argument("--limit", type=int, default=None, help="questions per Spec-Bench category (mt_bench, translation, ...; MT-Bench's own categories such as math share mt_bench's, taken in turn) (default all; --quick 1)")
    p.add_argument("--categories", default=None, help="comma-separated categories or groups (mt_bench, translation, ...)")
    p.add_argument("--all-turns", action="store_true", help="feed every turn of multi-turn questions (default: the first)")
    add_model_argument(p)
    add_numerics_arguments(p)
    p.add_argument("--repeats", type=int, default=None,
                   help=f"passes over the questions, each from the same start; medians are reported (default {FULL['repeats']}; --quick {QUICK['repeats']})")
    p.add_argument("--threads", type=int, default=None, help="torch threads, also llama.cpp's n_threads (default: torch's; with --ray, per worker, default 1)")
    p.add_argument("--opt", action="append", default=[], metavar="METHOD.KEY=VALUE", help="method option, e.g. pld.max_ngram=3 (repeatable)")
    p.add_argument("--out", default="bench-out", type=named, metavar="DIR", help="output folder (default bench-out)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out (DIR/checkpoint.json, written "
                   "after every question): finished questions are kept, the rest are run. Needs the same code and "
                   "settings; --limit and --categories may grow, so a full run can be built up over several sessions")
    p.add_argument("--quick", action="store_true", help="a few minutes: 1 question per category, 64 tokens, 5 repeats, fast methods, hf baseline")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_ray_arguments(p)
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print the change between two results files and exit")
    p.set_defaults(func=run)


def split_list(text: str | None) -> list[str]:
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def choose_baselines(text: str) -> list[str]:
    """--baselines: known names, or 'none' alone; an empty list is refused (as --methods refuses one),
    not taken for 'none'."""
    from .baselines import check_baselines

    if text.strip() == "none":
        return []
    baselines = split_list(text)
    if not baselines:
        raise InvalidParameter(f"--baselines names no baseline: {text!r} (give 'none' for none)")
    if "none" in baselines:
        raise InvalidParameter(f"--baselines: 'none' stands alone, got {text!r}")
    check_baselines(baselines)
    return baselines


def choose_methods(requested: str | None, quick: bool, notes: list[str]) -> list[str]:
    """User-named methods must exist; default lists keep only what is registered."""
    from ..engine import available_methods, build_decoder, method_spec
    from .execution import REFERENCE

    registered = available_methods()
    if requested is not None:
        names = split_list(requested)
        if not names:
            raise InvalidParameter(f"--methods names no method, got {requested!r}")
        for name in names:
            method_spec(name)  # raises UnknownMethod
    elif quick:
        names = [n for n in QUICK_METHODS if n in registered]
        missing = [n for n in QUICK_METHODS if n not in registered]
        if missing:
            notes.append(f"--quick: not registered, skipped: {', '.join(missing)}")
    else:  # every speculative method that builds without options of the user's (draft needs its draft_model)
        names = []
        for name in sorted(n for n, spec in registered.items() if spec.family == "speculative"):
            try:
                build_decoder(name)
                names.append(name)
            except DecodeKitError as err:
                notes.append(f"{name}: left out of the default methods ({err})")
    return [REFERENCE, *dict.fromkeys(n for n in names if n != REFERENCE)]


def parse_method_options(items: list[str], methods: list[str]) -> dict[str, dict[str, Any]]:
    """``METHOD.KEY=VALUE`` items as ``{method: {key: value}}``, each checked by the method's option specs."""
    from ..engine import method_spec, validate_options

    per_method: dict[str, list[str]] = {}
    for item in items:
        method, dot, rest = item.partition(".")
        if not dot or "=" not in rest:
            raise InvalidParameter(f"--opt expects METHOD.KEY=VALUE, got {item!r}")
        if method not in methods:
            raise InvalidParameter(f"--opt {item!r}: method {method!r} is not in --methods ({', '.join(methods)})")
        per_method.setdefault(method, []).append(rest)
    options = {method: parse_option_items(rest, method_spec(method).options, prefix=f"{method}.")
               for method, rest in per_method.items()}
    for method, given in options.items():
        validate_options(method, given)  # an unknown option fails now, not after loading the model
    return options


def check_methods_build(methods: list[str], options: dict[str, dict[str, Any]]) -> None:
    """Every method the user named can be built with its options (draft without its draft_model
    cannot): said in one line now, not as a note after the model has loaded."""
    from ..engine import build_decoder

    for method in methods:
        build_decoder(method, **options.get(method, {}))


def positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    check_int(f"--{name}", value)


def make_plan(args: argparse.Namespace) -> Plan:
    """Validate the arguments (unknown methods, baselines, categories, missing files) without loading a model."""
    from .checkpoint import CHECKPOINT
    from .execution import Plan, load_checkpoint
    from .questions import load_questions, resolve_question_file

    defaults = QUICK if args.quick else FULL
    max_new = args.max_new_tokens if args.max_new_tokens is not None else defaults["max_new_tokens"]
    limit = args.limit if args.limit is not None else defaults["limit"]
    repeats = args.repeats if args.repeats is not None else defaults["repeats"]
    for name, value, optional in (("max-new-tokens", max_new, False), ("limit", limit, True),
                                  ("repeats", repeats, False), ("threads", args.threads, True)):
        positive(name, value, optional)
    if args.threads is not None and getattr(args, "ray", None) is None and args.threads > (os.cpu_count() or 1):
        raise InvalidParameter(f"--threads {args.threads}: more than this machine's {os.cpu_count()} CPUs, which only "
                               f"makes the threads wait on each other")
    notes: list[str] = []
    methods = choose_methods(args.methods, args.quick, notes)
    baselines = choose_baselines(args.baselines if args.baselines is not None else defaults["baselines"])
    path = resolve_question_file(args.questions)
    categories = split_list(args.categories)
    if args.categories is not None and not categories:
        raise InvalidParameter(f"--categories names no category, got {args.categories!r}")
    fingerprint = hashlib.sha256(path.read_bytes()).hexdigest()  # as the questions are read, not at the first checkpoint
    plan = Plan(
        methods=methods, options=parse_method_options(args.opt, methods), baselines=list(dict.fromkeys(baselines)),
        questions=load_questions(path, categories=categories, limit=limit), question_file=path,
        question_file_sha256=fingerprint,
        max_new_tokens=max_new, limit=limit, categories=categories, repeats=repeats, all_turns=args.all_turns,
        model=args.model, dtype=args.dtype, numerics=args.numerics, threads=args.threads, out=Path(args.out), command="", notes=notes,
        resume=getattr(args, "resume", False), ray=getattr(args, "ray", None), workers=getattr(args, "workers", None),
    )
    if args.methods is not None:
        check_methods_build(plan.methods, plan.options)
    check_ray_arguments(plan.ray, plan.workers)
    plan.command = command_line(plan, args.quick)
    # (it makes nothing: a plan that fails later leaves no folder behind either)
    check_writable(plan.out, ("results.json", "report.md", "speedup.png", CHECKPOINT, CHECKPOINT + ".tmp"))
    if plan.resume:  # read (and check) now, not after loading the model
        plan.previous, plan.previous_notes = load_checkpoint(plan)
    elif (plan.out / CHECKPOINT).exists():  # (its results stay until this run's replace them)
        print(f"decodekit: {plan.out} holds an earlier run, which this one replaces (--resume continues it)",
              file=sys.stderr)
    return plan


def command_line(plan: Plan, quick: bool) -> str:
    """An explicit command that reproduces the run (every default spelled out)."""
    parts = ["decodekit", "bench", "--questions", str(plan.question_file), "--methods", ",".join(plan.methods),
             "--baselines", ",".join(plan.baselines) or "none", "--max-new-tokens", str(plan.max_new_tokens),
             "--repeats", str(plan.repeats), "--dtype", plan.dtype, "--numerics", plan.numerics,
             "--out", str(plan.out)]
    parts += ["--limit", str(plan.limit)] if plan.limit else []
    parts += ["--categories", ",".join(plan.categories)] if plan.categories else []
    parts += ["--model", plan.model] if plan.model else []
    parts += ["--threads", str(plan.threads)] if plan.threads else []
    parts += ["--all-turns"] if plan.all_turns else []
    parts += ["--resume"] if plan.resume else []
    parts += ["--ray", plan.ray] if plan.ray else []
    parts += ["--workers", str(plan.workers)] if plan.workers else []
    for method, opts in plan.options.items():
        for key, value in opts.items():  # a JSON object option (cost_table) as JSON, which --opt reads back
            parts += ["--opt", f"{method}.{key}={json.dumps(value) if isinstance(value, dict) else value}"]
    return shlex.join(parts) + ("  # --quick" if quick else "")


def check_compare_alone(args: argparse.Namespace) -> None:
    """``--compare`` reads two results files and runs nothing: a run flag beside it would be
    silently ignored, so it is refused (a flag left at its default counts as not given)."""
    given = [name for name in flags_given(args, add_arguments) if name != "compare"]
    if given:
        raise InvalidParameter(f"--compare reads two results files and runs nothing; --{given[0].replace('_', '-')} "
                               "does not go with it")


def run(args: argparse.Namespace) -> int:
    from .execution import execute
    from .report import compare, terminal_report
    from .results import load_results

    if args.compare:
        check_compare_alone(args)
        print(compare(load_results(args.compare[0]), load_results(args.compare[1])))
        return 0
    plan = make_plan(args)
    from ..models import load_model

    print(f"decodekit bench: {len(plan.questions)} questions x {len(plan.methods)} methods + "
          f"{len(plan.baselines)} baselines x {plan.repeats} repeat(s), {plan.max_new_tokens} new tokens", file=sys.stderr)
    if plan.ray is not None:
        from ..cluster import PoolSettings
        from .distributed import execute_on_ray

        settings = PoolSettings(workers=plan.workers, threads=plan.threads or 1)
        results = execute_on_ray(plan, plan.ray, settings, progress=not args.no_progress)
    else:
        results = execute(plan, load_model(plan.model, dtype=plan.dtype, numerics=plan.numerics), progress=not args.no_progress)
    print(terminal_report(results))
    print(f"\nwrote {plan.out / 'results.json'}, {plan.out / 'report.md'}, {plan.out / 'speedup.png'}")
    return 0
