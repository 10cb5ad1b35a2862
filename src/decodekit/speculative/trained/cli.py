"""``decodekit train-drafter``: self-distil data from the target, train an EAGLE, Medusa or Hydra drafter,
save it beside the model's cache, and evaluate it on held-aside queries."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ...arguments import add_model_arguments, check_writable, named
from ...errors import InvalidParameter
from ...models.cache import cache_root
from .data import PROMPTS, Exclusion, check_trainable, leaked, load_corpus, save_corpus, self_distil
from .store import cache_path, check_drafter_path, save, target_fingerprint
from .train import DEFAULT_HEADS, KINDS, Settings, draft_vocabulary, new_net, report, split, train


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", required=True, choices=KINDS)
    defaults = Settings("eagle")
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="self-distilled tokens to generate (made once per model and seed, then reused)")
    parser.add_argument("--prompts", choices=PROMPTS, default=defaults.prompts,
                        help="magpie: the model's own queries; tasks: every other one opens a task (summary, translation, "
                             "passages, word problem) whose material the model writes")
    parser.add_argument("--minutes", type=float, default=defaults.minutes, help="training time, after the data")
    parser.add_argument("--steps", type=int, default=None,
                        help="stop after this many optimiser steps if before --minutes (the same drafter on any machine)")
    parser.add_argument("--vocab", type=int, default=defaults.vocab, help="draft vocabulary size (the data's most frequent tokens)")
    parser.add_argument("--heads", type=int, default=None,
                        help="medusa, hydra: draft heads, each one token further (default: "
                             + ", ".join(f"{kind} {n}" for kind, n in DEFAULT_HEADS.items()) + ")")
    parser.add_argument("--unroll", type=int, default=defaults.unroll,
                        help="eagle: training steps on its own predicted features (1: the original EAGLE loss)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--eval-queries", type=int, default=defaults.held_out, help="held-aside queries to evaluate on")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per evaluation answer")
    parser.add_argument("--out", type=named, default=None, help="the drafter's file (default: the model's cache)")
    add_model_arguments(parser)
    parser.set_defaults(func=run)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace, model=None) -> int:
    from ...models import load_model

    settings = Settings(args.kind, tokens=args.tokens, prompts=args.prompts, minutes=args.minutes, steps=args.steps, vocab=args.vocab, seed=args.seed,
                        held_out=args.eval_queries, unroll=args.unroll, heads=args.heads)
    if args.max_new_tokens < 1:
        raise InvalidParameter(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    out = None if args.out is None else check_drafter_path(Path(args.out), args.out)
    if out is not None:
        check_writable(out.parent, given=out)
    model = model or load_model(args.model, backend=args.backend, dtype=args.dtype, numerics=args.numerics,
                                kv_cache=args.kv_cache)
    backend, tokenizer = model.backend, model.tokenizer
    if settings.vocab > backend.info.vocab_size:  # said before the data is made, not after
        raise InvalidParameter(f"--vocab {settings.vocab} is more than the model's {backend.info.vocab_size} tokens")
    check_trainable(backend)  # training needs it too, where the data was made before
    if args.max_new_tokens >= backend.info.max_length:  # the evaluation's answers: said now, not after the training
        raise InvalidParameter(f"--max-new-tokens {args.max_new_tokens} leaves no room for a query in the model's "
                               f"context of {backend.info.max_length} tokens")
    path = out or cache_path(backend, settings.kind)
    if out is None:  # the cache's place for it, checked as --out was before the model loaded
        if path.is_dir():
            raise InvalidParameter(f"{path} is a folder: the drafter's file cannot be saved there (remove it, or give --out)")
        check_writable(path.parent)
    recipe = "" if settings.prompts == "magpie" else f"-{settings.prompts}"
    # the features are the numerics' own: data recorded in one is not the other's
    numerics = getattr(backend, "numerics", "exact")
    corpus_path = (cache_root() / "drafters"
                   / f"{target_fingerprint(backend)}-data{recipe}-{numerics}-{settings.tokens}-s{settings.seed}.pt")
    corpus = load_corpus(corpus_path)
    if corpus is not None and leaked(corpus, Exclusion()):  # (an earlier version's, or edited): made again
        corpus = None
    if corpus is None:
        queries = "Magpie queries" + (", every other one opening a task" if settings.prompts == "tasks" else "")
        _say(f"self-distilling {settings.tokens} tokens from {backend.info.name} ({queries}, the model's answers)")
        made, t0 = [0], time.perf_counter()

        def progress(n: int) -> None:
            made[0] += n
            rate = made[0] / max(time.perf_counter() - t0, 1e-9)
            print(f"\r  data: {made[0]} tokens of {settings.tokens}, {rate:.0f} tok/s", end="",
                  file=sys.stderr, flush=True)

        corpus = self_distil(backend, tokenizer, settings.tokens, seed=settings.seed, prompts=settings.prompts,
                             progress=progress)
        _say("")
        save_corpus(corpus, corpus_path)
    _say(f"data: {corpus.tokens} tokens in {len(corpus.samples)} conversations ({corpus.seconds:.0f} s to make)")
    training, held = split(corpus, settings.held_out)
    vocab = draft_vocabulary(training, settings.vocab, backend.info.vocab_size)
    net = new_net(settings.kind, backend, vocab, settings)

    def progress_train(step: int, loss: float, metrics: dict) -> None:
        if step % 10 == 0:
            shown = " ".join(f"{k}={v:.3f}" for k, v in metrics.items())
            print(f"\r  train {settings.kind}: step {step} loss {loss:.4f} {shown}", end="", file=sys.stderr, flush=True)

    outcome = train(net, training, backend, settings, progress_train)
    _say(f"\ntrained {outcome.steps} steps in {outcome.seconds:.0f} s: loss {outcome.first_loss:.4f} -> {outcome.last_loss:.4f}")
    save(net, settings.kind, backend, path, report(settings, corpus, outcome, {}))
    evaluation = evaluate(model, settings.kind, path, [s.query for s in held], args.max_new_tokens)
    record = report(settings, corpus, outcome, evaluation)
    save(net, settings.kind, backend, path, record)
    record["drafter"] = str(path)
    record["drafter_bytes"] = path.stat().st_size
    print(json.dumps(record, indent=1))
    return 0


def evaluate(model, kind: str, path: Path, queries: list[str], max_new_tokens: int) -> dict:
    """Decode each query greedily with the drafter and plainly: mean accepted tokens per
    verification, and whether every answer is token-identical to plain greedy's."""
    from ...engine.api import Engine

    engine = Engine(model)
    accepted = verifications = identical = 0
    for query in queries:
        plain = engine.generate(query, method="greedy", max_new_tokens=max_new_tokens)
        drafted = engine.generate(query, method=kind, drafter=str(path), max_new_tokens=max_new_tokens)
        extra = drafted.stats.extra
        verifications += extra.get("verifications", 0)
        accepted += extra.get("accepted", 0)
        identical += plain.tokens == drafted.tokens
    return {
        "queries": len(queries),
        # None where nothing was verified (no query held aside, or the controller never drafted): not a figure
        "mean_accepted": round((accepted + verifications) / verifications, 3) if verifications else None,
        "identical_to_greedy": f"{identical}/{len(queries)}",
    }
