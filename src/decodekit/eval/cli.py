"""``decodekit eval TASK``: accuracy (Wilson CI), tokens, time and uncertainty-signal AUROCs."""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
from pathlib import Path

from ..arguments import (ArgumentParser, add_model_arguments, add_ray_arguments, check_ray_arguments, check_writable,
                         flags_given, named)
from ..errors import InvalidParameter
from ..options import check_int, parse_option_items

METHOD_CHOICES = ("greedy", "sample", "beam", "cot", "best-of-n", "self-consistency", "weighted-vote", "mbr",
                  "first-finish", "step-beam", "particle", "astar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .tasks import LONG_CONTEXT, TASKS

    parser.add_argument("task", help=f"task: {', '.join(sorted(TASKS))}, {LONG_CONTEXT} (KV-cache policies on long inputs)")
    parser.add_argument("--method", default="greedy", help=f"decoding method ({', '.join(METHOD_CHOICES)}, or any registered)")
    parser.add_argument("--n", type=int, default=8, help="samples / beam width / branches (method-dependent; default 8)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N items")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's (gsm8k 256, capitals 16)")
    parser.add_argument("--seed", type=int, default=0, help="item i uses hash(seed) + i * 2^32, and its samples the seeds after it")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (search methods default to 0.7)")
    parser.add_argument("--signals", default="", help="extra uncertainty signals, comma-separated: agreement (n samples), pc (paraphrases)")
    parser.add_argument("--paraphrases", type=int, default=4, help="k for PC@k: that many distinct rephrasings (default 4; the shipped tasks have 5)")
    parser.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="method option (repeatable)")
    parser.add_argument("--data", default=None, help="task data file (gsm8k: JSONL with question/answer; structured: id/prompt/schema)")
    parser.add_argument("--unconstrained", action="store_true", help="structured: decode without the schema (to compare validity and speed)")
    parser.add_argument("--policies", default=None, help="longctx: kv cache policies, ';'-separated (default: full; int8; int4; "
                        "sink:4,window:1024; h2o:budget=1024,window=128; snapkv:budget=1024,window=32)")
    parser.add_argument("--lengths", default=None, help="longctx: context lengths in tokens, comma-separated (default 2048,4096,8000,16384)")
    parser.add_argument("--depths", default=None, help="longctx: pass-key depths in [0, 1], comma-separated (default 0.1,0.5,0.9)")
    parser.add_argument("--continuation", type=int, default=None, help="longctx: tokens whose NLL is measured (default 128)")
    parser.add_argument("--out", default=None, type=named, help="output folder (default eval-out/TASK-METHOD, eval-out/TASK-METHOD-unconstrained with "
                        "--unconstrained; longctx: eval-out/longctx)")
    parser.add_argument("--resume", action="store_true", help="continue the run saved in --out (DIR/checkpoint.json, written "
                        "after every item) with the same code and settings; --limit may grow")
    add_model_arguments(parser)
    add_ray_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, model=None) -> int:
    """Run the evaluation; ``model`` skips loading by name, for tests and notebooks: a LoadedModel,
    or with ``--ray`` a picklable callable that returns one (each worker calls it once)."""
    from ..engine import check_model_cache, method_spec
    from ..models import load_model
    from ..bench.checkpoint import CHECKPOINT
    from .checkpoint import Progress, resume_key
    from .checkpoint import load as load_checkpoint
    from .checkpoint import save as save_checkpoint
    from .report import write_report
    from .runner import EvalConfig, evaluate, item_count, make_decoder, method_options
    from .tasks import LONG_CONTEXT, load_task

    for flag in ("n", "limit", "max_new_tokens", "paraphrases", "continuation"):
        if getattr(args, flag) is not None:
            check_int(f"--{flag.replace('_', '-')}", getattr(args, flag))
    check_ray_arguments(args.ray, args.workers)
    check_task_flags(args, LONG_CONTEXT)
    out = output_folder(args, LONG_CONTEXT)
    check_writable(out, ("results.json", "report.md", "plot.png", CHECKPOINT, CHECKPOINT + ".tmp"))
    if args.task == LONG_CONTEXT:
        if args.ray is not None:
            raise InvalidParameter("--ray runs item-by-item tasks; longctx runs on one machine (its rows share one long prompt)")
        return run_long_context(args, out, model)
    signals = [s.strip() for s in args.signals.split(",") if s.strip()]
    if args.signals.strip() and not signals:  # given, but naming none: as bench's --categories
        raise InvalidParameter(f"--signals names no signal, got {args.signals!r}")
    if len(set(signals)) < len(signals):
        raise InvalidParameter(f"--signals names a signal twice: {args.signals!r}")
    if "pc" not in signals and "paraphrases" in flags_given(args, add_arguments, [args.task]):
        raise InvalidParameter("--paraphrases applies to --signals pc (it would be ignored)")
    config = EvalConfig(
        method=args.method, n=args.n, limit=args.limit, max_new_tokens=args.max_new_tokens, seed=args.seed,
        temperature=args.temperature, options=parse_option_items(args.opt, method_spec(args.method).options),
        signals=signals, paraphrases=args.paraphrases, constrained=not args.unconstrained,
    )
    task = load_task(args.task, args.data)
    if args.unconstrained and not any(item.constraint for item in task.items):
        raise InvalidParameter(f"--unconstrained: task {args.task!r} has no constraint to leave out")
    decoder = make_decoder(config, task)  # bad method or option: fail before loading the model
    check_model_cache(config.method, method_options(config, task), decoder, args.kv_cache)
    if "pc" in config.signals and task.items:
        task.paraphrase(task.items[0], config.paraphrases)  # more than the task has: fail before loading
    recipe = functools.partial(load_model, args.model, backend=args.backend, dtype=args.dtype, numerics=args.numerics,
                               kv_cache=args.kv_cache)
    key = resume_key(task, run_settings(args, config, task))
    resumed = load_checkpoint(out, key, task) if args.resume else Progress()  # read now, not after loading the model
    count = item_count(task, config)
    taken = [r for i, r in resumed.records.items() if i < count]
    if args.resume:
        print(f"--resume: {len(taken)} of {count} items done in {out / CHECKPOINT}", file=sys.stderr)
    right = [sum(r["correct"] for r in taken)]

    def saved(progress: Progress) -> None:
        save_checkpoint(out, key, progress)

    def progress(done: int, total: int, record: dict) -> None:
        right[0] += record["correct"]
        print(f"\r[{done}/{total}] correct {right[0]}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    if args.ray is not None:
        from ..cluster import PoolSettings
        from .distributed import evaluate_on_ray

        if model is not None and not callable(model):
            raise InvalidParameter("with --ray, pass a callable that loads the model (each worker calls it), not a model")
        result = evaluate_on_ray(model or recipe, task, config, args.ray, PoolSettings(workers=args.workers), progress,
                                 resumed=resumed, checkpoint=saved)
        name = result["machines"][0]["model"]  # a pool has at least one worker
    else:
        model = model or recipe()
        result = evaluate(model, task, config, progress, resumed=resumed, checkpoint=saved)
        name = model.name
    result["resumed_items"] = len(taken)
    header = {"command": command_line(args), "model": name, "dtype": args.dtype, "numerics": args.numerics}
    paths = write_report(result, out, header)
    lo, hi = result["ci95"]
    print(f"{args.task} · {args.method}: accuracy {result['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] "
          f"({result['correct']}/{result['items']}), {result['tokens_spent']} tokens, {result['time_s']} s")
    for name, value in result["auroc"].items():
        print(f"  AUROC {name}: {'n/a' if value is None else f'{value:.3f}'}")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def run_settings(args: argparse.Namespace, config, task) -> dict:
    """Every setting that changes an item's record: a checkpoint is resumed only under the same ones."""
    from .runner import uses_n

    return {"method": config.method, "n": config.n if uses_n(config) else None, "seed": config.seed,
            "temperature": config.temperature, "options": config.options, "signals": list(config.signals),
            "paraphrases": config.paraphrases if "pc" in config.signals else None, "constrained": config.constrained,
            "max_new_tokens": config.max_new_tokens or task.max_new_tokens, "model": args.model, "backend": args.backend,
            "dtype": args.dtype, "numerics": args.numerics, "kv_cache": args.kv_cache}


#: The flags of the long-context evaluation alone, and those of the item-by-item tasks alone.
LONG_CONTEXT_FLAGS = ("policies", "lengths", "depths", "continuation")
ITEM_FLAGS = ("data", "unconstrained", "signals", "opt", "method", "n", "limit", "max_new_tokens", "temperature",
              "paraphrases", "kv_cache", "resume")  # longctx runs greedy decoding under its own --policies


def check_task_flags(args: argparse.Namespace, long_context: str) -> None:
    """A flag given for a task it does not apply to is refused, not silently ignored (a flag left
    at its default counts as not given)."""
    others = ITEM_FLAGS if args.task == long_context else LONG_CONTEXT_FLAGS
    given = [flag for flag in flags_given(args, add_arguments, [args.task]) if flag in others]
    if given:
        which = f"{long_context} only" if args.task != long_context else f"the item tasks, not {long_context}"
        raise InvalidParameter(f"--{given[0].replace('_', '-')} applies to {which}")


def _numbers(flag: str, text: str, kind, lo: float, hi: float) -> tuple:
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(not lo <= v <= hi for v in values):
        raise InvalidParameter(f"--{flag} must be comma-separated numbers in [{lo}, {hi}], got {text!r}")
    if len(set(values)) < len(values):  # a repeat would be reported under one key, its other result lost
        raise InvalidParameter(f"--{flag} names a value twice: {text!r}")
    return values


def output_folder(args: argparse.Namespace, long_context: str) -> Path:
    """``--out``, or the task's default folder."""
    if args.out:
        return Path(args.out)
    if args.task == long_context:
        return Path("eval-out/longctx")
    return Path(f"eval-out/{args.task}-{args.method}" + ("-unconstrained" if args.unconstrained else ""))


def command_line(args: argparse.Namespace) -> str:
    """A command that reproduces the run: the task and every flag not at its default, wherever
    it was given on the command line (but --resume: a resumed run's records are one run's)."""
    parser = ArgumentParser()
    add_arguments(parser)
    parts = ["decodekit", "eval", args.task]
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "resume") or value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            parts.append(flag)
        elif isinstance(value, list):
            for item in value:
                parts += [flag, str(item)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def run_long_context(args: argparse.Namespace, out: Path, model=None) -> int:
    """``decodekit eval longctx`` (:mod:`.longctx`)."""
    from ..models import load_model
    from ..models.kv_policy import parse_kv_cache
    from .longctx import LONGEST, LongContextConfig, evaluate_long_context, write

    if args.continuation is not None:  # (a windowed cache would read a huge one for ever)
        check_int("--continuation", args.continuation, 1, LONGEST)
    config = LongContextConfig(seed=args.seed, **({} if args.continuation is None else {"continuation": args.continuation}))
    if args.policies is not None:
        parts = [p.strip() for p in args.policies.strip().strip(";").split(";")]  # (a first or last ';' is harmless)
        config.policies = tuple(p for p in parts if p)
        if not config.policies:
            raise InvalidParameter(f"--policies must name kv cache policies, ';'-separated, got {args.policies!r}")
        if len(config.policies) < len(parts):
            raise InvalidParameter(f"--policies names an empty policy between two ';': {args.policies!r}")
    for policy in config.policies:
        parse_kv_cache(policy)  # a bad spelling: one line, before loading
    if args.lengths is not None:
        config.lengths = _numbers("lengths", args.lengths, int, 16, LONGEST)
    if args.depths is not None:
        config.depths = _numbers("depths", args.depths, float, 0.0, 1.0)
    model = model or load_model(args.model, backend=args.backend, dtype=args.dtype, numerics=args.numerics)

    def progress(row: dict) -> None:
        summary = row.get("error") or f"NLL {row['nll']:.4f}, {row['cache_bytes'] / 1e6:.1f} MB at peak, {row['decode_tok_s']:.1f} tok/s"
        print(f"{row['length']:>6} {row['policy']:<32} {summary}", file=sys.stderr, flush=True)

    result = evaluate_long_context(model, config, progress)
    result.update({"command": command_line(args), "model": model.name, "numerics": args.numerics})
    paths = write(result, out)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    from ..errors import DecodeKitError

    parser = ArgumentParser(prog="python -m decodekit.eval", description=__doc__)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except DecodeKitError as err:
        print(f"decodekit eval: error: {err}", file=sys.stderr)
        return 2
