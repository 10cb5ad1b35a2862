"""Time to read a long prompt while other requests decode, the passes shared in one batcher as
``decodekit serve`` shares them (the prompt read a chunk at a time beside the decoding rows), on the
embedded model in the fast numerics. Random tokens: what is timed is the passes, not the text.

    .venv/bin/python scripts/busy_prefill.py [--tokens 4000] [--others 7]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from decodekit.models import load_model
from decodekit.models.batching import PassBatcher, single_threaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000, help="the long prompt's tokens")
    parser.add_argument("--others", type=int, default=7, help="requests decoding meanwhile (100-token prompts)")
    args = parser.parse_args()
    base = load_model(numerics="fast").backend
    batcher = PassBatcher()
    stop, ready = threading.Event(), threading.Barrier(args.others + 1)

    def decode(seed: int) -> None:  # a request decoding one token a pass until the prompt is read
        single_threaded()
        backend = base.clone()
        backend.batcher = batcher
        generator = torch.Generator().manual_seed(seed)
        with batcher.member():
            backend.append(torch.randint(0, 40000, (1, 100), generator=generator), last_only=True)
            ready.wait()
            while not stop.is_set():
                backend.append(torch.randint(0, 40000, (1, 1), generator=generator), last_only=True)

    others = [threading.Thread(target=decode, args=(seed,)) for seed in range(args.others)]
    for thread in others:
        thread.start()
    reader = base.clone()
    reader.batcher = batcher
    prompt = torch.randint(0, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(args.others))
    with batcher.member():
        ready.wait()
        start = time.perf_counter()
        reader.append(prompt, last_only=True)
        took = time.perf_counter() - start
    stop.set()
    for thread in others:
        thread.join()
    print(f"a {args.tokens}-token prompt beside {args.others} decoding requests: {took:.2f} s "
          f"({args.tokens / took:.0f} tok/s); {batcher.passes} passes, {batcher.rows} rows")


if __name__ == "__main__":
    main()
