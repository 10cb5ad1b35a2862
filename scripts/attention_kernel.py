"""The attention kernel against an earlier version of itself: bit-identical outputs, and the time
of one pass's attention over all 30 layers of the embedded model's shape (9 query heads, 3
key/value heads, head size 64), with the caches cold (each layer its own). A pass of several rows
has the mask a verification chain or a prefill chunk has: each row sees the context and the
rows up to itself.

    .venv/bin/python scripts/attention_kernel.py --against 905ae4f   # any git revision of attention.c
    .venv/bin/python scripts/attention_kernel.py --against HEAD --contexts 256,6000 --rows 1,8,32   # an uncommitted change
    .venv/bin/python scripts/attention_kernel.py --against 9f348fe --bit-keys 256   # bits compared up to 256 keys

--bit-keys bounds the key counts whose bits are compared: against a version with other arithmetic
past some count (9f348fe and before: no segments, so the same bits up to one segment of 256 keys).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from decodekit.models.kernels.build import compiler_flags, level

KERNELS = Path(__file__).resolve().parents[1] / "src/decodekit/models/kernels"


def compile_source(source: str, folder: Path, name: str) -> ctypes.CDLL:
    path = folder / f"{name}.c"
    path.write_text(source)
    flags = compiler_flags("attention", level() or "avx512")  # this CPU's level, as the package builds it
    subprocess.run(["gcc", *flags, "-I", str(KERNELS), str(path), "-o", str(folder / f"{name}.so")], check=True)
    lib = ctypes.CDLL(str(folder / f"{name}.so"))
    lib.decodekit_attention_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return lib


def attend(lib, q, k, v, visible, threads=2) -> torch.Tensor:
    n_q, heads, dim = q.shape
    out = torch.empty(n_q, heads, dim)
    lib.decodekit_attention_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if visible is None else visible.data_ptr(),
                                out.data_ptr(), n_q, heads, k.shape[0], dim, k.shape[1], k.shape[1], dim**-0.5, threads)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", required=True, help="git revision whose attention.c is compared")
    parser.add_argument("--contexts", default="2000,6000")
    parser.add_argument("--rows", default="1,2,5")
    parser.add_argument("--bit-keys", type=int, default=300, help="the most keys whose bits are compared")
    args = parser.parse_args()
    old_source = subprocess.run(["git", "show", f"{args.against}:src/decodekit/models/kernels/attention.c"],
                                check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"old": compile_source(old_source, Path(tmp), "old"),
                "new": compile_source((KERNELS / "attention.c").read_text(), Path(tmp), "new")}
        g = torch.Generator().manual_seed(0)
        for trial in range(100):  # shapes, masks: the same bits (head sizes of the grouped jobs and the general one)
            rows, keys, dim = 1 + trial % 7 + 16 * (trial % 3 == 0), 1 + (trial * 37) % args.bit_keys, (64, 128, 48, 16)[trial % 4]
            q, k, v = torch.randn(rows, 9, dim, generator=g), torch.randn(3, keys, dim, generator=g), torch.randn(3, keys, dim, generator=g)
            visible = None if trial % 2 else (torch.rand(rows, keys, generator=g) < 0.7).to(torch.uint8)
            assert torch.equal(attend(libs["old"], q, k, v, visible), attend(libs["new"], q, k, v, visible)), trial
        print(f"bit-identical on 100 random shapes and masks of up to {args.bit_keys} keys (a third of them 17 rows or more: blocks of rows)")
        for context in map(int, args.contexts.split(",")):
            for rows in map(int, args.rows.split(",")):
                layers = [(torch.randn(3, context + rows, 64), torch.randn(3, context + rows, 64)) for _ in range(30)]
                q = torch.randn(rows, 9, 64)
                visible = None if rows == 1 else torch.ones(rows, context + rows, dtype=torch.uint8).tril(context)
                times = {}
                for turn in range(11):  # alternating, the fastest of eleven each
                    for name, lib in (libs.items() if turn % 2 else reversed(libs.items())):
                        took = _timed(lambda: [attend(lib, q, k, v, visible) for k, v in layers])
                        times[name] = min(times.get(name, took), took)
                print(f"context {context}, {rows} row(s), 30 layers: "
                      + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in times.items())
                      + f", new / old {times['new'] / times['old']:.2f}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
