"""Time a trained drafter's draft calls and the verification passes they feed, on the embedded model.

    .venv/bin/python scripts/drafter_timing.py --kind eagle [--numerics fast] [--budget 8]

Prints the mean draft time, the pass time of the tree it drafted, and a plain step's time, over the
first dev questions, so the drafter's share of a speculative step can be read against a plain step.
"""

from __future__ import annotations

import argparse
import time

import torch

from decodekit.data import SPEC_BENCH_QUESTIONS, data_file, read_jsonl
from decodekit.engine.core import DecodeState, GenerationStats
from decodekit.models import load_model
from decodekit.samplers import Sampler
from decodekit.speculative.drafters import DRAFTER_SPECS
from decodekit.speculative.tree import Verification


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="eagle")
    parser.add_argument("--numerics", default="fast")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--questions", type=int, default=4)
    args = parser.parse_args()
    model = load_model(None, numerics=args.numerics)
    backend, tokenizer = model.backend, model.tokenizer
    rows = [row for _, row in read_jsonl(data_file(SPEC_BENCH_QUESTIONS))][: args.questions]
    draft_s, plain_s, verify_s, nodes = [], [], [], []
    for row in rows:
        ids = list(tokenizer.prompt_prefix) + tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": row["turns"][0]}]))
        state = DecodeState(backend, Sampler(greedy=True), ids, GenerationStats())
        state.prefill()
        drafter = DRAFTER_SPECS[args.kind].factory()
        drafter.begin(state)
        state.commit([int(state.next_logits().argmax())])
        for _ in range(24):
            t0 = time.perf_counter()
            tree = drafter.draft(state, args.budget)
            t1 = time.perf_counter()
            out = backend.verify_tree(torch.tensor([state.tokens[-1], *tree.tokens]), [-1, *[p + 1 for p in tree.parents]])
            t2 = time.perf_counter()
            backend.commit_path([0])  # keep the root only: a plain step's worth of progress
            token = int(out.logits[0, 0].argmax())
            drafter.update(state, tree, Verification([], token), out.logits[0])
            state.commit([token])
            t3 = time.perf_counter()
            backend.step(torch.tensor([token]))
            plain_s.append(time.perf_counter() - t3)
            backend.truncate(backend.length - 1)
            draft_s.append(t1 - t0)
            verify_s.append(t2 - t1)
            nodes.append(len(tree))
    mean = lambda xs: 1000 * sum(xs) / len(xs)  # noqa: E731
    print(f"{args.kind} ({args.numerics}, budget {args.budget}): draft {mean(draft_s):.2f} ms for {sum(nodes) / len(nodes):.1f} nodes; "
          f"verify pass {mean(verify_s):.2f} ms; plain step {mean(plain_s):.2f} ms")


if __name__ == "__main__":
    main()
