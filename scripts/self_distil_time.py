"""How fast the trained drafters' self-distilled data is made: Magpie queries drafted, then answered
16 at a time as members of the pass batcher, on the embedded model in the fast numerics. Prints a
hash of every sample's tokens (the same data, whatever the code's speed) and the wall time.

    .venv/bin/python scripts/self_distil_time.py 15000      # tokens of data to make
"""

from __future__ import annotations

import hashlib
import sys
import time

import decodekit
from decodekit.speculative.trained.data import self_distil


def main() -> None:
    engine = decodekit.Engine(numerics="fast")
    start = time.perf_counter()
    corpus = self_distil(engine.model.backend, engine.model.tokenizer, int(sys.argv[1]), seed=3)
    wall = time.perf_counter() - start
    digest = hashlib.sha256(repr([s.tokens for s in corpus.samples]).encode()).hexdigest()[:16]
    print(f"{corpus.tokens} tokens, {len(corpus.samples)} samples (tokens' hash {digest}) in {wall:.1f} s: "
          f"{corpus.tokens / wall:.1f} tok/s")


if __name__ == "__main__":
    main()
