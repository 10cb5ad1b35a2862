"""What a decode step spends choosing its token, and the decode rate around it, on the embedded model:
plain greedy and plain sampling (temperature 0.7) on the first questions of the Spec-Bench dev split,
the median time of the sampler's pick per step and the decode tokens per second; then `pld` sampling
(whose verification draws a keyed sample for every row it checks) against plain sampling. One
process per call, so that two builds can be run alternately and compared.

    .venv/bin/python scripts/step_cost.py [--questions 4] [--tokens 128] [--numerics fast]
"""

from __future__ import annotations

import argparse
import statistics
import time

from decodekit.bench.questions import read_questions, resolve_question_file
from decodekit.engine import Engine
from decodekit.models import load_model
from decodekit.samplers import Sampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--numerics", default="fast", choices=["exact", "fast"])
    args = parser.parse_args()
    engine = Engine(load_model(numerics=args.numerics))
    prompts = [q.turns[0] for q in read_questions(resolve_question_file())[: args.questions]]
    picks: list[float] = []
    pick_at = Sampler.pick_at

    def timed(sampler, *a, **kw):
        t0 = time.perf_counter()
        try:
            return pick_at(sampler, *a, **kw)
        finally:
            picks.append(time.perf_counter() - t0)

    Sampler.pick_at = timed
    try:
        sampling = {"temperature": 0.7, "seed": 1}
        for method, params in (("greedy", {}), ("sample", sampling), ("pld", sampling)):
            engine.generate(prompts[0], method=method, max_new_tokens=16, **params)  # untimed
            picks.clear()
            tokens = seconds = 0.0
            for prompt in prompts:
                g = engine.generate(prompt, method=method, max_new_tokens=args.tokens, **params)
                tokens, seconds = tokens + len(g.tokens), seconds + g.stats.decode_s
            print(f"{method}: pick {statistics.median(picks) * 1e6:.0f} us (median), decode {tokens / seconds:.1f} tok/s")
    finally:
        Sampler.pick_at = pick_at

if __name__ == "__main__":
    main()
