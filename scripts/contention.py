"""Decode speed when another process takes a core: quiet, then beside a busy loop, without the
thread governor and with it (the default), in one run.

    .venv/bin/python scripts/contention.py
"""

from __future__ import annotations

import torch

from decodekit.bench.profile import contention
from decodekit.models import load_model
from decodekit.models.threads import GOVERNOR


def main() -> None:
    model, threads = load_model(), torch.get_num_threads()
    for enabled in (False, True):
        GOVERNOR.enabled = enabled
        torch.set_num_threads(threads)  # the governor may have left one thread set
        result = contention(model)
        print(f"{'governor' if enabled else 'no governor'}: quiet {result['quiet_tok_s']:.0f} tok/s, beside a busy "
              f"loop {result['busy_core_tok_s']:.0f} tok/s ({result['ratio']:.2f}x)")


if __name__ == "__main__":
    main()
