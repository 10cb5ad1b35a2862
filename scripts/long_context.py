"""Long-context benchmarks of the KV-cache family, on the embedded model.

``kvdraft``: plain greedy against ``kvdraft`` (the model with a compressed cache drafts, its full
cache verifies) on long prompts built from the packaged Spec-Bench texts (each a different slice
of them, then "Summarise the text above."), ``--new`` tokens each, requests alternating, the
first pair a warm-up (the controller's cost table and acceptance estimates carry over between
requests, as in a long-running process). Every kvdraft output is checked token-identical to greedy's.

``streaming``: one generation of ``--new`` tokens with a StreamingLLM cache (EOS ignored); the
cache's entries, its allocation and the process's RSS every ``--every`` tokens.

``decode``: the one-token step after ``--tokens`` of context under each cache policy, one model
each (sharing the weights), 16 steps a round then rolled back, policies alternating round by
round, the fastest round of ``--rounds`` kept: what the cache costs a decode step, where the
machine's noise moves every policy alike.

    .venv/bin/python scripts/long_context.py kvdraft [--tokens 6000] [--prompts 3] [--new 128] [--numerics exact] [--budget N] [--kv-cache sink:S,window:W]
    .venv/bin/python scripts/long_context.py streaming [--new 32768] [--kv-cache sink:4,window:1024] [--stream-text]
    .venv/bin/python scripts/long_context.py decode [--tokens 2048,4096,8000] [--kv-cache 'full;int8;int4'] [--numerics fast]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import time

from decodekit.data import SPEC_BENCH_QUESTIONS, data_file
from decodekit.engine import Engine
from decodekit.models import LoadedModel, load_model
from decodekit.speculative.drafters.kvdraft import DEFAULT_CACHE as KVDRAFT_CACHE


def documents(tokenizer, length: int, count: int) -> list[list[dict]]:
    texts = [t for line in data_file(SPEC_BENCH_QUESTIONS).read_text().splitlines() for t in json.loads(line)["turns"]]
    ids = tokenizer.encode("\n\n".join(texts * 4))
    step = max(1, (len(ids) - length) // max(count, 1))
    return [[{"role": "user", "content": tokenizer.decode(ids[i * step : i * step + length]) + "\n\nSummarise the text above."}]
            for i in range(count)]


def kvdraft(args: argparse.Namespace) -> None:
    model = load_model(numerics=args.numerics)
    engine = Engine(model)
    prompts = documents(model.tokenizer, args.tokens, args.prompts + 1)
    options = {"draft_cache": args.kv_cache, **({"budget": args.budget} if args.budget else {})}
    rows = []
    for i, prompt in enumerate(prompts):
        plain = engine.generate(prompt, max_new_tokens=args.new, ignore_eos=True)
        spec = engine.generate(prompt, method="kvdraft", max_new_tokens=args.new, ignore_eos=True, **options)
        if spec.tokens != plain.tokens:
            raise SystemExit(f"prompt {i}: kvdraft's tokens differ from greedy's")
        extra = spec.stats.extra
        row = {"prompt_tokens": len(model.prompt_ids(prompt)), "greedy_tok_s": plain.stats.new_tokens / plain.stats.decode_s,
               "kvdraft_tok_s": spec.stats.new_tokens / spec.stats.decode_s, "verifications": extra.get("verifications", 0),
               "accepted": extra.get("accepted", 0), "warm_up": i == 0}
        row["speedup"] = row["kvdraft_tok_s"] / row["greedy_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    timed = [r for r in rows if not r["warm_up"]]
    greedy = statistics.mean(r["greedy_tok_s"] for r in timed)
    spec = statistics.mean(r["kvdraft_tok_s"] for r in timed)
    accepted = sum(r["accepted"] for r in timed) / max(sum(r["verifications"] for r in timed), 1)
    print(json.dumps({"numerics": args.numerics, "kv_cache": args.kv_cache, "budget": args.budget or "controller", "greedy_tok_s": round(greedy, 1),
                      "kvdraft_tok_s": round(spec, 1), "speedup": round(spec / greedy, 3),
                      "accepted_per_verification": round(accepted, 2), "identical": True}))


def streaming(args: argparse.Namespace) -> None:
    model = load_model(numerics=args.numerics)
    backend = model.backend.with_kv_cache(args.kv_cache)
    engine = Engine(LoadedModel(backend, model.tokenizer, model.name))
    samples = []
    start = time.perf_counter()

    def sample() -> bool:  # asked after every step (should_stop): records, never stops
        if backend.length // args.every > len(samples):
            samples.append({"tokens": backend.length, "slots": backend.slots, "cache_mb": round(backend.cache_bytes() / 1e6, 2),
                            "allocated_mb": round(2 * backend._k.nbytes / 1e6, 2),
                            "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                            "seconds": round(time.perf_counter() - start, 1)})
            print(json.dumps(samples[-1]), flush=True)
        return False

    streamed: list[str] = []  # with --stream-text, the text arrives as a client of the server would get it
    out = engine.generate("Tell me a very long story.", max_new_tokens=args.new, ignore_eos=True, should_stop=sample,
                          on_text=streamed.append if args.stream_text else None)
    print(json.dumps({"kv_cache": args.kv_cache, "new_tokens": out.stats.new_tokens,
                      "tok_s": round(out.stats.new_tokens / out.stats.decode_s, 1),
                      "max_cache_mb": max(s["cache_mb"] for s in samples), "max_allocated_mb": max(s["allocated_mb"] for s in samples),
                      "first_rss_mb": samples[0]["rss_mb"], "last_rss_mb": samples[-1]["rss_mb"],
                      "context_window": model.backend.info.max_length}))


def decode(args: argparse.Namespace) -> None:
    import torch

    base = load_model(numerics=args.numerics).backend
    for length in (int(n) for n in args.tokens.split(",")):
        backends = {spec: base.with_kv_cache(spec) for spec in args.kv_cache.split(";")}
        ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(0))
        for backend in backends.values():
            backend.append(ids, last_only=True)
        best = dict.fromkeys(backends, float("inf"))
        for _ in range(args.rounds):
            for spec, backend in backends.items():
                start = time.perf_counter()
                for t in range(16):
                    backend.step(torch.tensor([1000 + t]))
                best[spec] = min(best[spec], (time.perf_counter() - start) / 16)
                backend.truncate(length)
        for spec, backend in backends.items():
            print(json.dumps({"tokens": length, "kv_cache": spec, "step_ms": round(best[spec] * 1e3, 2),
                              "tok_s": round(1 / best[spec], 1), "vs_full": round(best.get("full", math.nan) / best[spec], 2),
                              "cache_mb": round(backend.cache_bytes() / 1e6, 1)}), flush=True)
        del backends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kvdraft")
    k.add_argument("--tokens", type=int, default=6000)
    k.add_argument("--prompts", type=int, default=3)
    k.add_argument("--new", type=int, default=128)
    k.add_argument("--kv-cache", default=KVDRAFT_CACHE)
    k.add_argument("--numerics", default="exact")
    k.add_argument("--budget", type=int, default=0, help="a fixed chain length (default: the controller decides)")
    k.set_defaults(func=kvdraft)
    s = sub.add_parser("streaming")
    s.add_argument("--new", type=int, default=32768)
    s.add_argument("--every", type=int, default=2048)
    s.add_argument("--kv-cache", default="sink:4,window:1024")
    s.add_argument("--numerics", default="exact")
    s.add_argument("--stream-text", action="store_true", help="also stream the text out (on_text), as a server does")
    s.set_defaults(func=streaming)
    d = sub.add_parser("decode")
    d.add_argument("--tokens", default="2048,4096,8000", help="context lengths, comma-separated")
    d.add_argument("--kv-cache", default="full;int8;int4", help="policies, ';'-separated")
    d.add_argument("--numerics", default="fast")
    d.add_argument("--rounds", type=int, default=5)
    d.set_defaults(func=decode)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
