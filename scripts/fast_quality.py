"""What the ``fast`` numerics costs in quality, on the packaged Spec-Bench dev questions.

For each question (first turn, chat template): the ``exact`` model's greedy answer of up to 128
tokens is the reference. Reported: the mean teacher-forced negative log-likelihood per token of
the reference answers under ``exact`` and under ``fast`` (one prefill of prompt + answer each),
and how often ``fast`` greedy gives exactly the reference tokens, with the mean length of the
common prefix.

    .venv/bin/python scripts/fast_quality.py [--limit N]   # N questions per category (default all)
"""

from __future__ import annotations

import argparse
import statistics

import torch

from decodekit.bench.questions import load_questions, resolve_question_file
from decodekit.engine import Engine
from decodekit.models import load_model

MAX_NEW_TOKENS = 128


def answer_nll(backend, prompt: list[int], answer: list[int]) -> float:
    """Summed negative log-likelihood of ``answer`` after ``prompt``, teacher-forced in one pass."""
    backend.reset(1)
    logits = backend.append(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1].float()
    return -torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(answer)[:, None]).sum().item()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="questions per category (default all)")
    args = parser.parse_args()
    questions = load_questions(resolve_question_file(None), limit=args.limit)
    exact, fast = Engine(load_model()), Engine(load_model(numerics="fast"))
    nll = {"exact": 0.0, "fast": 0.0}
    tokens, identical, prefixes = 0, 0, []
    for q in questions:
        prompt = exact.model.prompt_ids(q.turns[0])
        reference = exact.generate(prompt, max_new_tokens=MAX_NEW_TOKENS).tokens
        got = fast.generate(prompt, max_new_tokens=MAX_NEW_TOKENS).tokens
        identical += got == reference
        prefixes.append(common_prefix(got, reference))
        if reference:
            tokens += len(reference)
            for name, engine in (("exact", exact), ("fast", fast)):
                nll[name] += answer_nll(engine.model.backend, prompt, reference)
    mean = {name: total / tokens for name, total in nll.items()}
    print(f"{len(questions)} questions, {tokens} reference tokens (exact greedy, up to {MAX_NEW_TOKENS} a question)")
    print("| | exact | fast |\n|---|---:|---:|")
    print(f"| mean NLL per reference token (nats) | {mean['exact']:.4f} | {mean['fast']:.4f} "
          f"({100 * (mean['fast'] / mean['exact'] - 1):+.2f}%) |")
    print(f"| greedy answer identical to exact's | all | {identical}/{len(questions)} ({100 * identical / len(questions):.0f}%) |")
    print(f"| mean common prefix with exact's answer (tokens) | - | {statistics.mean(prefixes):.1f} |")


if __name__ == "__main__":
    main()
