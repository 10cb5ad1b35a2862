"""Decode speed when another process takes a core: quiet, then beside a busy loop, with the thread
governor (the default) and without it (``DECODEKIT_THREAD_GOVERNOR=0``), in one run.

    .venv/bin/python scripts/contention.py --requests 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import torch

from decodekit.engine import Engine
from decodekit.models import load_model

PROMPT = "What are the main causes of the French Revolution? Answer briefly."


def tokens_per_second(engine: Engine, requests: int) -> float:
    rates = []
    for _ in range(requests):
        out = engine.generate(PROMPT, max_new_tokens=64)
        rates.append(len(out.tokens) / out.stats.decode_s)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6, help="64-token requests per figure (median)")
    args = parser.parse_args()
    engine = Engine(load_model())
    engine.generate(PROMPT, max_new_tokens=16)  # warm-up
    results, threads = {}, torch.get_num_threads()
    for governed in (False, True):
        os.environ["DECODEKIT_THREAD_GOVERNOR"] = "1" if governed else "0"
        torch.set_num_threads(threads)  # the governor may have left one thread set
        quiet = tokens_per_second(engine, args.requests)
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            engine.generate(PROMPT, max_new_tokens=16)  # let the governor see the busy core first
            shared = tokens_per_second(engine, args.requests)
        finally:
            spinner.kill()
            spinner.wait()
        results["governor" if governed else "no governor"] = (quiet, shared)
    for name, (quiet, shared) in results.items():
        print(f"{name}: quiet {quiet:.0f} tok/s, beside a busy loop {shared:.0f} tok/s ({shared / quiet:.2f}x)")


if __name__ == "__main__":
    main()
