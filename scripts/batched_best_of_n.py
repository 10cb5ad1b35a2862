"""Benchmark: batched best-of-N against N sequential ``Engine.generate`` samples of the same length.

Row i of the batch samples with seed ``seed + i``, exactly like the i-th sequential call, so both
sides produce the same samples (the same token count) and only the schedule differs.

    .venv/bin/python scripts/batched_best_of_n.py [--n 8] [--max-new-tokens 64] [--dtype float32] [--numerics exact] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from decodekit.arguments import add_model_argument, add_numerics_arguments
from decodekit.engine import Engine
from decodekit.models import LoadedModel, load_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def compare(model: LoadedModel, prompt: str = PROMPT, n: int = 8, max_new_tokens: int = 64, seed: int = 0) -> dict[str, Any]:
    """Time one batched best-of-N and N sequential sampled generations; return the figures."""
    engine = Engine(model)
    engine.generate(prompt, method="sample", seed=seed, max_new_tokens=4)  # warm-up
    t0 = time.perf_counter()
    batched = engine.generate(prompt, method="best-of-n", n=n, temperature=1.0, seed=seed, max_new_tokens=max_new_tokens)
    t_batch = time.perf_counter() - t0
    t0 = time.perf_counter()
    sequential = [engine.generate(prompt, method="sample", seed=seed + i, max_new_tokens=max_new_tokens) for i in range(n)]
    t_seq = time.perf_counter() - t0
    batch_tokens = sum(c["tokens"] for c in batched.extra["candidates"])
    seq_tokens = sum(g.stats.new_tokens for g in sequential)
    same = sum(c["text"] == g.text for c, g in zip(batched.extra["candidates"], sequential))
    return {
        "n": n, "max_new_tokens": max_new_tokens, "batched_s": round(t_batch, 3), "sequential_s": round(t_seq, 3),
        "speedup": round(t_seq / t_batch, 2), "batched_tokens": batch_tokens, "sequential_tokens": seq_tokens,
        "identical_samples": same,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/batched_best_of_n.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser)
    add_numerics_arguments(parser)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype, numerics=args.numerics)
    for r in range(args.repeats):
        print(json.dumps(compare(model, n=args.n, max_new_tokens=args.max_new_tokens, seed=args.seed + 100 * r)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
