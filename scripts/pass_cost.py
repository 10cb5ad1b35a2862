"""What one forward pass of k tokens costs on the embedded model, after a context: the fastest and
the median of many passes (each appended after the context, then rolled back), one process per
call, so that two builds of the kernels can be run alternately and compared pass size by pass size.

    .venv/bin/python scripts/pass_cost.py --rows 1,8,32 --passes 300 [--numerics exact] [--context 256] [--phases 40]

``--phases N`` also prints the median of each run of N passes in order: on a virtual machine whose
cores the host moves around, a pass of several rows can cost a third or a half more for a while,
and the medians show when.

``decodekit profile`` reports the same costs as the fastest of three; on a machine whose speed drifts,
the fastest of hundreds, with builds alternating, is what separates a few percent.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decodekit.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32", help="comma-separated tokens a pass")
    parser.add_argument("--passes", type=int, default=300, help="timed passes of each size")
    parser.add_argument("--numerics", default="fast", choices=["exact", "fast"])
    parser.add_argument("--context", type=int, default=256, help="tokens in the cache before each pass")
    parser.add_argument("--phases", type=int, default=0, help="also the median of each run of this many passes")
    args = parser.parse_args()
    backend = load_model(numerics=args.numerics).backend
    generator = torch.Generator().manual_seed(0)
    backend.reset(1)
    backend.append(torch.randint(0, 40000, (1, args.context), generator=generator), last_only=True)
    origin = backend.length
    for rows in (int(r) for r in args.rows.split(",")):
        times = []
        for _ in range(args.passes + 1):  # the first is untimed
            tokens = torch.randint(0, 40000, (1, rows), generator=generator)
            start = time.perf_counter()
            backend.append(tokens)
            times.append(time.perf_counter() - start)
            backend.truncate(origin)
        times = times[1:]
        print(f"{rows} tokens: fastest {min(times) * 1e3:.2f} ms, median {statistics.median(times) * 1e3:.2f} ms")
        if args.phases > 0:
            runs = [times[i : i + args.phases] for i in range(0, len(times), args.phases)]
            print("  medians in order (ms):", " ".join(f"{statistics.median(run) * 1e3:.1f}" for run in runs))


if __name__ == "__main__":
    main()
