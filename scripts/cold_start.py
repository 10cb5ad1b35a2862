"""What a cold start costs each speculative method: paired runs from an empty memory.

For every quick-bench question and every repeat, each method runs once on a fresh backend clone
(nothing learnt: no acceptance estimates, corpus or successor table; the verify-cost table read
from the cache, as a new process would), right next to a plain greedy run on another fresh clone,
the two in alternating order; both clones get one warm-up request first, as in ``decodekit
bench``. The figure per question is the median over repeats of greedy's time per token divided
by the method's (>1: faster than greedy). Pairing adjacent runs cancels the machine's slow
drift, which on a shared virtual machine is larger than the effect measured.

    .venv/bin/python scripts/cold_start.py --methods pld,suffix,recycling,lookahead --repeats 8
"""

from __future__ import annotations

import argparse
import math
import statistics

from decodekit.bench.contestants import WARMUP_PROMPT
from decodekit.bench.questions import load_questions
from decodekit.engine import Engine
from decodekit.models import LoadedModel, load_model
from decodekit.speculative import prepare


def fresh_engine(model: LoadedModel, method: str) -> Engine:
    """A clone with an empty memory, warmed up with one request of ``method``."""
    engine = Engine(LoadedModel(model.backend.clone(), model.tokenizer, model.name))
    prepare(engine.model.backend)
    engine.generate(WARMUP_PROMPT, method=method, max_new_tokens=32)
    return engine


def seconds_per_token(engine: Engine, ids: list[int], method: str, max_new_tokens: int) -> float:
    out = engine.generate(list(ids), method=method, max_new_tokens=max_new_tokens)
    return out.stats.decode_s / max(1, len(out.tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="pld,suffix,recycling,lookahead")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    methods = args.methods.split(",")
    model = load_model()
    ratios: dict[str, dict[str, list[float]]] = {m: {} for m in methods}
    for question in load_questions(limit=1):
        ids = model.prompt_ids([{"role": "user", "content": question.turns[0]}])
        for repeat in range(args.repeats):
            for method in methods:
                pair = [(fresh_engine(model, "greedy"), "greedy"), (fresh_engine(model, method), method)]
                if repeat % 2:
                    pair.reverse()
                times = {name: seconds_per_token(engine, ids, name, args.max_new_tokens) for engine, name in pair}
                ratios[method].setdefault(question.category, []).append(times["greedy"] / times[method])
    categories = list(next(iter(ratios.values())))
    print("| method | " + " | ".join(categories) + " | all (geometric mean) |")
    print("|---" * (len(categories) + 2) + "|")
    for method, by_category in ratios.items():
        every = [r for values in by_category.values() for r in values]
        overall = math.exp(statistics.fmean(math.log(r) for r in every))
        cells = [f"{statistics.median(by_category[c]):.3f}" for c in categories]
        print(f"| {method} | " + " | ".join(cells) + f" | {overall:.3f} |")


if __name__ == "__main__":
    main()
