"""How long a model takes to read a prompt of random token ids (``backend.prefill``), once, or
the fastest of several reads (``--repeats``).

    .venv/bin/python scripts/prefill_time.py --model gemma3-270m --numerics exact --tokens 8192
    .venv/bin/python scripts/prefill_time.py --numerics fast --tokens 512 --warmup --repeats 12
    /usr/bin/time -f "%M KB %e s" .venv/bin/python scripts/prefill_time.py ...     # and its peak memory
"""

from __future__ import annotations

import argparse
import time

import torch

from decodekit.arguments import add_model_argument, add_numerics_arguments
from decodekit.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_numerics_arguments(parser)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--warmup", action="store_true", help="read a 64-token prompt first (kernels built, caches warm)")
    parser.add_argument("--repeats", type=int, default=1, help="reads of the prompt, the fastest reported")
    args = parser.parse_args()
    model = load_model(args.model, dtype=args.dtype, numerics=args.numerics)
    vocab = model.backend.info.vocab_size
    ids = torch.randint(vocab // 50, vocab // 10, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    if args.warmup:
        model.backend.prefill(ids[:64])
    seconds = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        logits = model.backend.prefill(ids)
        seconds = min(seconds, time.perf_counter() - start)
    print(f"{model.name} {args.numerics}: prefill of {args.tokens} tokens {seconds:.3f} s ({args.tokens / seconds:.0f} tok/s; "
          f"first logits {logits[0, :3].tolist()})")


if __name__ == "__main__":
    main()
