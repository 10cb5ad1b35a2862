"""Where the AVX2 integer kernel's cycles go, without timing anything: ``llvm-mca`` on the loops GCC
makes of ``gemm_q8.c``'s ``half_tile`` for one kind of block and a tile of input rows.

    .venv/bin/python scripts/integer_kernel_mca.py                  # Q4_1, 8 input rows, Zen 3
    .venv/bin/python scripts/integer_kernel_mca.py --kind Q8_0 --rows 4 --cpu skylake

The tile's walk over the blocks is a loop (unpack the half's weights, the integer sums of every
input row, the float sums of every input row) around an inner loop over the input rows (the
integer sums). The script compiles a wrapper that calls ``half_tile`` alone with the flags decodekit
builds the AVX2 level with, cuts those three pieces out of the assembly, asks llvm-mca for each
piece's cycles in a steady state, and prints the cycles a block of 32 inputs takes for the tile and
the multiply-adds a cycle that implies (against the 64 of two ``vpmaddubsw`` a cycle). A static
model: it knows nothing of caches or memory, so it is a ceiling for passes whose weights stay near.
Needs gcc and llvm-mca.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

from decodekit.models.kernels.build import compiler_flags

KERNELS = Path(__file__).resolve().parents[1] / "src/decodekit/models/kernels"
WRAPPER = """#include "gemm_q8.c"
__attribute__((noinline)) void probe(const uint8_t *group, const Quantised *in, float *y, int n_out, int n_in) {
    half_tile(KIND_%s, group, 0, 1, in, y, n_out, n_in, 0, %d);
}
"""


def probe_assembly(kind: str, rows: int, work: Path) -> list[str]:
    """The wrapper's body as GCC writes it, one instruction or label a line."""
    (work / "probe.c").write_text(WRAPPER % (kind, rows))
    flags = [f for f in compiler_flags("gemm_q8", "avx2") if f not in ("-shared", "-lm")]
    subprocess.run(["gcc", *flags, f"-I{KERNELS}", "-S", str(work / "probe.c"), "-o", str(work / "probe.s")], check=True)
    text = (work / "probe.s").read_text().splitlines()
    start = text.index("probe:")
    end = next(i for i in range(start, len(text)) if text[i].startswith("\t.size\tprobe,"))
    return [line for line in text[start:end] if not line.lstrip().startswith((".cfi", ".p2align", "#"))]


def loop_pieces(lines: list[str]) -> dict[str, list[str]]:
    """Cut the block loop into the unpacking before the inner loop, the inner loop, and what follows it
    (or, where GCC unrolled the loop over the input rows, the block loop whole)."""
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.match(r"^\.L\d+:$", line)}
    backward = [(labels[m.group(1)], i) for i, line in enumerate(lines)
                if (m := re.match(r"^\s+j\w+\s+(\.L\d+)$", line)) and m.group(1) in labels and labels[m.group(1)] < i]
    loops = sorted(backward, key=lambda p: p[1] - p[0])  # innermost first
    inner = next((s, e) for s, e in loops if any("vpmaddubsw" in line for line in lines[s:e]))
    outer = next(((s, e) for s, e in loops if s < inner[0] and e > inner[1]), None)
    if outer is None:
        return {"block": lines[inner[0] + 1:inner[1] + 1]}
    return {"unpack": lines[outer[0] + 1:inner[0]], "inner": lines[inner[0] + 1:inner[1] + 1],
            "after": lines[inner[1] + 1:outer[1] + 1]}


def cycles(piece: list[str], cpu: str, work: Path) -> float:
    """llvm-mca's cycles an iteration of `piece`, run 200 times over."""
    (work / "piece.s").write_text("\n".join(piece) + "\n")
    out = subprocess.run(["llvm-mca", f"-mcpu={cpu}", "-iterations=200", str(work / "piece.s")],
                         check=True, capture_output=True, text=True).stdout
    return int(re.search(r"Total Cycles:\s+(\d+)", out).group(1)) / 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="Q4_1", choices=["Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0"])
    parser.add_argument("--rows", type=int, default=8, choices=range(1, 9), metavar="1..8")
    parser.add_argument("--cpu", default="znver3", help="llvm-mca's -mcpu (default znver3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pieces = loop_pieces(probe_assembly(args.kind, args.rows, work))
        each = {name: cycles(piece, args.cpu, work) for name, piece in pieces.items()}
    inner_runs = args.rows  # the inner loop runs once an input row
    block = sum(value * (inner_runs if name == "inner" else 1) for name, value in each.items())
    macs = 8 * 32 * args.rows  # 8 output rows (half a group) x 32 inputs x the tile's rows
    print(f"{args.kind}, {args.rows} input rows, {args.cpu}: a block of 32 inputs for half a group (8 output rows)")
    for name, value in each.items():
        runs = f" x {inner_runs}" if name == "inner" else ""
        print(f"  {name:<7} {value:6.1f} cycles{runs}   ({len(pieces[name])} lines)")
    print(f"  total   {block:6.1f} cycles: {macs / block:.1f} multiply-adds a cycle (two vpmaddubsw a cycle: 64)")


if __name__ == "__main__":
    main()
