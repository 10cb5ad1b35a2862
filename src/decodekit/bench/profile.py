"""``decodekit profile``: what a forward pass costs on this machine, and how close that is to its limits.

For the model in each numerics (``exact``: float32 on the GGUF blocks; ``fast``: 8-bit inputs and
integer dot products, where this machine and model have it): the time of a pass of 1, 2, 4, ... 64
new tokens after a 256-token context (the verify-cost curve every speculative method lives on),
prefill speed for a 512-token prompt, and what those imply: the weight bandwidth of a one-token
pass (bytes of weights it reads per second, against a measured copy bandwidth) and the
multiply-add rate of a 32-token pass (against a measured float32 matrix-product rate for
``exact``, the rate of a loop of the integer kernel's dot-product instructions for ``fast``:
VNNI's, or AVX2's). ``--contention`` adds decode speed beside a busy loop
(another process spinning on one core), in each numerics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from ..arguments import add_model_arguments

PASS_SIZES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = 512
COPY_BYTES = 256 * 2**20  # far beyond the caches: a copy this size streams from memory
GEMM_SIZE = 2048  # large enough for the matrix product to run near the multiply-add peak
PEAK_ITERATIONS = 2_000_000  # rounds of 12 x 64 byte products a thread: a few milliseconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    for action in p._actions:  # one numerics, or (the default here) both side by side
        if action.dest == "numerics":
            action.default, action.help = None, "profile this numerics only (default: both, exact and fast)"
    p.add_argument("--contention", action="store_true", help="also decode beside a busy loop on one core")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def best_of(fn, rounds: int = 5) -> float:
    """The fastest of ``rounds`` timed calls after one untimed one (load from other processes only
    ever slows a call down)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def machine_limits() -> dict[str, float | None]:
    """A STREAM-like copy (bytes read + written per second), the rate of a large float32 matrix
    product (torch's, through oneDNN: the multiply-add rate this machine reaches in practice) and
    the rate of a loop of nothing but the integer kernel's byte dot products (VNNI's, or AVX2's; None
    without the integer kernel)."""
    import torch

    from ..models.kernels import integer_peak_loop
    from .results import cpu_model

    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    copy_s = best_of(lambda: dst.copy_(src))
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    gemm_s = best_of(lambda: torch.mm(a, b))
    loop, threads = integer_peak_loop(), torch.get_num_threads()
    vnni = None
    if loop is not None:
        vnni_s = best_of(lambda: loop(PEAK_ITERATIONS, threads))
        vnni = round(2 * 64 * 12 * PEAK_ITERATIONS * threads / vnni_s / 1e9, 1)
    return {
        "cpu": cpu_model(),  # the figures below are this CPU's
        "copy_gb_s": round(2 * COPY_BYTES / copy_s / 1e9, 2),
        "fma_gflop_s": round(2 * GEMM_SIZE**3 / gemm_s / 1e9, 1),
        "vnni_gop_s": vnni,  # byte multiply-adds, two operations each (the key issue 15 named; AVX2's loop too)
    }


def pass_costs(model) -> dict[str, Any]:
    """Pass times (ms) after a 256-token context, prefill tokens/s, and the rates they imply."""
    import torch

    from ..speculative.controller import CostTable

    backend = model.backend
    table = CostTable.measure(backend, sizes=PASS_SIZES)  # at its shortest context, 256 tokens
    pass_ms = {str(n): round(table(n, table.at) * 1e3, 3) for n in PASS_SIZES}
    prompt_tokens = min(PREFILL_TOKENS, backend.info.max_length - 1)  # (a model of a shorter context: all of it)
    prompt = torch.randint(0, backend.info.vocab_size, (1, prompt_tokens))

    def prefill() -> None:
        backend.reset(1)
        backend.append(prompt, last_only=True)

    prefill_s = best_of(prefill, rounds=3)
    backend.reset(1)
    out: dict[str, Any] = {"context": table.at, "pass_ms": pass_ms,
                           "prefill_tok_s": round(prompt_tokens / prefill_s, 1), "prefill_tokens": prompt_tokens}
    traffic = backend.weight_traffic()
    if traffic is not None:
        weight_bytes, macs = traffic
        out["weight_gb_s_at_1"] = round(weight_bytes / (pass_ms["1"] / 1e3) / 1e9, 2)
        out["gflop_s_at_32"] = round(2 * macs * 32 / (pass_ms["32"] / 1e3) / 1e9, 1)
    return out


def decode_speed(model, requests: int = 4) -> float:
    """Median tokens/s of greedy 64-token requests, after one untimed request (which also lets the
    thread governor see how the machine is now)."""
    from ..engine import Engine

    engine = Engine(model)
    engine.generate("Explain how a bicycle works.", max_new_tokens=16)
    rates = []
    for _ in range(requests):
        out = engine.generate("Explain how a bicycle works.", max_new_tokens=64)
        rates.append(len(out.tokens) / out.stats.decode_s)
    return statistics.median(rates)


def contention(model) -> dict[str, float]:
    """Greedy decode speed quiet and beside another process spinning on one core."""
    quiet = decode_speed(model)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        shared = decode_speed(model)
    finally:
        spinner.kill()
        spinner.wait()
    return {"quiet_tok_s": round(quiet, 1), "busy_core_tok_s": round(shared, 1), "ratio": round(shared / quiet, 3)}


# what a numerics' 32-token multiply-add rate is set against: (its share's name, the machine's rate)
PEAKS = {"exact": ("fma_share_at_32", "fma_gflop_s"), "fast": ("vnni_share_at_32", "vnni_gop_s")}


def profile(models: dict[str, Any], *, with_contention: bool = False, unavailable: dict[str, str] | None = None) -> dict[str, Any]:
    """The whole profile as one object (what ``--json`` prints). ``models``: a loaded model per
    numerics; ``unavailable``: why a numerics has none."""
    from ..models.threads import GOVERNOR

    result: dict[str, Any] = {"model": next(iter(models.values())).name, "numerics": {}}
    with GOVERNOR.hold():  # all threads throughout: figures of one thread count
        machine = result["machine"] = machine_limits()
        for numerics, model in models.items():
            costs = result["numerics"][numerics] = pass_costs(model)
            share, peak = PEAKS[numerics]
            if "weight_gb_s_at_1" in costs:
                costs["bandwidth_share_at_1"] = round(costs["weight_gb_s_at_1"] / machine["copy_gb_s"], 3)
                if machine[peak]:
                    costs[share] = round(costs["gflop_s_at_32"] / machine[peak], 3)
    for numerics, reason in (unavailable or {}).items():
        result["numerics"][numerics] = {"unavailable": reason}
    if with_contention:
        result["contention"] = {numerics: contention(model) for numerics, model in models.items()}
    return result


def describe(result: dict[str, Any]) -> str:
    lines = [f"model {result['model']}"]
    m = result["machine"]
    vnni = f", integer dot-product loop {m['vnni_gop_s']} GOP/s" if m["vnni_gop_s"] else ""
    lines.append(f"machine: {m['cpu']}, copy {m['copy_gb_s']} GB/s (read + write), float32 matrix product "
                 f"{m['fma_gflop_s']} GFLOP/s{vnni}")
    for numerics, r in result["numerics"].items():
        if "unavailable" in r:
            lines.append(f"{numerics}: unavailable ({r['unavailable']})")
            continue
        sizes = "  ".join(f"{n}:{ms:.2f}" for n, ms in r["pass_ms"].items())
        lines.append(f"{numerics}: pass ms after {r['context']} tokens (tokens:ms)  {sizes}")
        one = r["pass_ms"]["1"]
        lines.append("  x one token: " + "  ".join(f"{n}:{ms / one:.2f}" for n, ms in r["pass_ms"].items()))
        lines.append(f"  prefill {r['prefill_tok_s']} tok/s ({r.get('prefill_tokens', PREFILL_TOKENS)}-token prompt)")
        if "weight_gb_s_at_1" in r:
            lines.append(f"  one-token pass reads weights at {r['weight_gb_s_at_1']} GB/s "
                         f"({100 * r['bandwidth_share_at_1']:.0f}% of the copy bandwidth)")
            share, _ = PEAKS[numerics]
            rate = "matrix-product" if numerics == "exact" else "integer dot-product loop"
            against = f" ({100 * r[share]:.0f}% of the {rate} rate)" if share in r else ""
            lines.append(f"  32-token pass computes {r['gflop_s_at_32']} G operations/s (two a multiply-add){against}")
    for numerics, c in result.get("contention", {}).items():
        lines.append(f"contention, {numerics}: decode {c['quiet_tok_s']} tok/s quiet, {c['busy_core_tok_s']} beside a "
                     f"busy loop ({c['ratio']:.2f}x)")
    return "\n".join(lines)


def run(args: argparse.Namespace, models: dict[str, Any] | None = None) -> int:
    """Profile both numerics (``models``: a loaded model per numerics, else loaded from the
    arguments; a numerics this model or machine cannot run is reported as unavailable)."""
    from ..errors import InvalidParameter
    from ..models import load_model

    unavailable: dict[str, str] = {}
    if models is None:
        chosen = getattr(args, "numerics", None)
        models = {}
        for numerics in [chosen] if chosen else ["exact", "fast"]:
            try:
                models[numerics] = load_model(args.model, backend=args.backend, dtype=args.dtype, numerics=numerics,
                                              kv_cache=args.kv_cache)
            except InvalidParameter as err:
                if chosen or numerics == "exact":  # asked for by name, or nothing left to profile
                    raise
                unavailable[numerics] = str(err)
    result = profile(models, with_contention=args.contention, unavailable=unavailable)
    print(json.dumps(result) if args.json else describe(result))
    return 0
