"""How often sampled drafts are accepted: keyed coupling (the default) against rejection sampling.

A draft model at temperature draws its chain with the target's keyed noise at each position
(`Sampler.sample_at`), and the keyed verifier accepts a draft token when it equals the target's
keyed sample; speculative sampling (`SamplingVerifier`) accepts with probability min(1, p/q).
Same prompts, seeds, drafter and fixed draft budget for both; prints the acceptance rate.

    .venv/bin/python scripts/coupling.py --draft-layers 20 --temperature 0.8 --seeds 8
"""

from __future__ import annotations

import argparse

from decodekit.engine.core import Request, StepDecoder
from decodekit.models import load_model
from decodekit.samplers import Sampler
from decodekit.speculative import SamplingVerifier
from decodekit.speculative.controller import Controller
from decodekit.speculative.drafters import DRAFTER_SPECS
from decodekit.speculative.loop import SpeculativeMethod

PROMPTS = ("Tell a short story about a fox.", "Explain how a bicycle works.", "Write a letter to a friend about autumn.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft-layers", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    model = load_model()
    drafter = DRAFTER_SPECS["draft"].factory(draft_model=f"self-truncated:{args.draft_layers}", stochastic=True,
                                             confidence=0.0)
    for label, verifier in (("keyed coupling", None), ("rejection sampling", SamplingVerifier())):
        accepted = drafted = 0
        for prompt in PROMPTS:
            ids = model.prompt_ids(prompt)
            for seed in range(args.seeds):
                method = SpeculativeMethod(drafter, Controller(args.budget, budget=args.budget), verifier)
                sampler = Sampler.from_params(temperature=args.temperature, seed=seed)
                StepDecoder(method).generate(model, Request(list(ids), sampler, max_new_tokens=args.max_new_tokens))
                accepted += method.accepted
                drafted += method.drafted
        print(f"{label}: {accepted}/{drafted} draft tokens accepted ({accepted / max(drafted, 1):.3f})")


if __name__ == "__main__":
    main()
