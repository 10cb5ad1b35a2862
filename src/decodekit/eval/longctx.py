"""``decodekit eval longctx``: what each KV-cache policy costs in quality, memory and speed on long inputs.

Two tasks, both built from what the package ships (nothing downloaded):

* **Continuation NLL.** The Spec-Bench questions' texts concatenated into one document; its first
  ``length`` tokens are read as the context, then the next ``continuation`` tokens are fed one
  at a time (as decoding feeds them, so a policy evicts as it would while generating) and their
  mean negative log-likelihood is reported, and its change relative to the full cache.
* **Pass-key retrieval** (Mohtashami & Jaggi, 2023, "Landmark Attention"): a five-digit number
  hidden at several depths of repeated filler text; the model is asked for it and answers
  greedily; correct when the number appears in the answer.

Per policy and length: NLL, pass-key accuracy by depth, the cache's peak bytes while the context
and the continuation are read (the most entries held at once, :meth:`NativeLlama.cache_bytes`:
SnapKV holds the whole context before it compresses it, H2O evicts as it reads) and decode tokens
per second. A policy
that cannot hold a length (the full cache past the context window) is reported as such.
Writes ``results.json``, ``report.md`` and ``plot.png`` (NLL change against cache memory).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..arguments import replace_text, save_figure
from ..data import SPEC_BENCH_QUESTIONS, data_file
from ..errors import InvalidParameter
from ..options import check_int

DEFAULT_POLICIES = ("full", "int8", "int4", "sink:4,window:1024", "h2o:budget=1024,window=128", "snapkv:budget=1024,window=32")
DEFAULT_LENGTHS = (2048, 4096, 8000, 16384)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


PASSKEY_ANSWER_TOKENS = 8  # a five-digit number and what the model says around it


#: The longest context, and continuation, an evaluation reads (a windowed cache has no bound of its own).
LONGEST = 1 << 20


@dataclass
class LongContextConfig:
    policies: tuple[str, ...] = DEFAULT_POLICIES
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    continuation: int = 128
    decode_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("continuation", self.continuation, 1, LONGEST)  # its NLL is a mean over these tokens


def document_tokens(tokenizer, needed: int) -> list[int]:
    """At least ``needed`` tokens of the Spec-Bench questions' texts, concatenated (repeated if short)."""
    lines = data_file(SPEC_BENCH_QUESTIONS).read_text(encoding="utf-8").splitlines()
    texts = [turn for line in lines for turn in json.loads(line)["turns"]]
    ids: list[int] = []
    while len(ids) < needed:
        ids += tokenizer.encode("\n\n".join(texts) + "\n\n")
    return ids[:needed]


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """About ``length`` tokens (at most, and within one filler sentence): filler with the pass key at
    ``depth`` (0 = start, 1 = end), then the question."""
    head = "There is important information hidden in this text. Find it and remember it.\n"
    needle = f"The pass key is {key}. Remember it. {key} is the pass key.\n"
    question = "\nWhat is the pass key? The pass key is"

    def prompt(repeats: int) -> list[int]:
        before = round(repeats * depth)
        return tokenizer.encode(head + FILLER * before + needle + FILLER * (repeats - before) + question)

    fixed = len(prompt(0))
    repeats = max(1, (length - fixed) // max(len(tokenizer.encode(FILLER)), 1))
    # repeated, the filler tokenizes shorter than alone (its sentences merge at their joins): measured once, resized
    per_repeat = (len(prompt(repeats)) - fixed) / repeats
    return prompt(max(1, int((length - fixed) / max(per_repeat, 1e-9))))


def continuation_nll(backend, ids: list[int], context: int) -> float:
    """Mean NLL of ``ids[context:]`` given what precedes, read one token a pass after the context."""
    logits = backend.prefill(ids[:context])[0]
    total = 0.0
    for token in ids[context:]:
        total -= float(torch.log_softmax(logits.float(), -1)[token])
        logits = backend.step(torch.tensor([token]))[0]
    return total / (len(ids) - context)


def run_policy(model, policy: str, length: int, config: LongContextConfig, rng: random.Random) -> dict[str, Any]:
    """One policy at one length: NLL, memory, speed and pass-key answers."""
    from ..engine import Engine
    from ..errors import DecodeKitError
    from ..models import LoadedModel

    row: dict[str, Any] = {"policy": policy, "length": length}
    try:
        backend = model.backend.with_kv_cache(policy)  # "full" too: whatever cache the model was loaded with
    except DecodeKitError as err:  # a policy this model does not take (Gemma 3's sliding windows): its rows say so
        row["error"] = str(err)
        return row
    engine = Engine(LoadedModel(backend, model.tokenizer, model.name))
    after = max(config.continuation, config.decode_tokens, PASSKEY_ANSWER_TOKENS)  # the most any run reads past the context
    if length + after > backend.info.max_length:  # said now, not after thousands of passes
        row["error"] = (f"{length} + {after} tokens after it exceed the context of {backend.info.max_length} "
                        "this cache holds")
        return row
    ids = document_tokens(model.tokenizer, length + config.continuation)
    measured: dict[str, Any] = {}
    try:
        measured["nll"] = continuation_nll(backend, ids, length)
        measured["cache_bytes"] = backend.cache_bytes(peak=True)
        out = engine.generate(ids[:length], max_new_tokens=config.decode_tokens, ignore_eos=True)
        measured["decode_tok_s"] = out.stats.new_tokens / max(out.stats.decode_s, 1e-9)
        measured["prefill_s"] = out.stats.prefill_s
        measured["passkey"] = {}
        for depth in config.depths:
            key = rng.randrange(10000, 100000)
            prompt = passkey_prompt(model.tokenizer, length, depth, key)
            answer = engine.generate(prompt, max_new_tokens=PASSKEY_ANSWER_TOKENS).text
            measured["passkey"][str(depth)] = str(key) in answer
    except (DecodeKitError, ValueError) as err:  # e.g. the full cache past the context window: no figure of it kept
        row["error"] = str(err)
        return row
    return {**row, **measured}


def evaluate_long_context(model, config: LongContextConfig, progress=None) -> dict[str, Any]:
    """Every policy at every length; NLL changes are relative to the full cache at the same length."""
    from ..models.kv_policy import parse_kv_cache

    for policy in config.policies:
        parse_kv_cache(policy)  # a bad spelling fails before any work
    if not hasattr(model.backend, "with_kv_cache"):
        raise InvalidParameter(f"eval longctx needs the native backend, not {model.backend.info.architecture}")
    rows = []
    for length in config.lengths:
        for policy in config.policies:
            row = run_policy(model, policy, length, config, random.Random(f"{config.seed}-{length}"))
            rows.append(row)
            if progress:
                progress(row)
    for row in rows:
        full = next((r for r in rows if r["length"] == row["length"] and r["policy"] == "full" and "nll" in r), None)
        if full is not None and "nll" in row:
            row["nll_change"] = row["nll"] / full["nll"] - 1
            row["memory_saved"] = 1 - row["cache_bytes"] / full["cache_bytes"]
    return {"task": "longctx", "config": config.__dict__, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    depths = result["config"]["depths"]
    lines = [
        "# decodekit eval: longctx",
        "",
        f"- command: `{result.get('command', '')}`",
        f"- model: {result.get('model', '')}, {result.get('numerics', '')} numerics; continuation "
        f"{result['config']['continuation']} tokens, decode speed over {result['config']['decode_tokens']} tokens",
        "",
        "| length | policy | NLL | vs full | peak cache MB | saved | decode tok/s | pass-key " + " ".join(f"@{d}" for d in depths) + " |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['length']} | {r['policy']} | — | — | — | — | — | {r['error']} |")
            continue
        change = f"{100 * r['nll_change']:+.2f}%" if "nll_change" in r else "—"
        saved = f"{100 * r['memory_saved']:.0f}%" if "memory_saved" in r else "—"
        keys = " ".join("yes" if r["passkey"][str(d)] else "no" for d in depths)
        lines.append(f"| {r['length']} | {r['policy']} | {r['nll']:.4f} | {change} | {r['cache_bytes'] / 1e6:.1f} | "
                     f"{saved} | {r['decode_tok_s']:.1f} | {keys} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """NLL change against cache memory, one point per policy and length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=130)
    policies = list(dict.fromkeys(r["policy"] for r in result["rows"]))
    colors = plt.get_cmap("tab10")
    for i, policy in enumerate(policies):
        points = [r for r in result["rows"] if r["policy"] == policy and "nll_change" in r]
        if points:
            ax.plot([r["cache_bytes"] / 1e6 for r in points], [100 * r["nll_change"] for r in points], "o-",
                    color=colors(i % 10), label=policy)
            for r in points:
                ax.annotate(f"{r['length']}", (r["cache_bytes"] / 1e6, 100 * r["nll_change"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("peak KV cache while reading context and continuation (MB, log scale)")
    ax.set_ylabel("continuation NLL vs full cache (%)")
    ax.set_title(f"Quality against memory: {result.get('model', '')} (labels: context tokens)", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no policy gave a point: no legend to draw
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def write(result: dict[str, Any], out: Path) -> list[Path]:
    replace_text(out / "results.json", json.dumps(result, indent=1))
    replace_text(out / "report.md", markdown(result))
    plot(result, out / "plot.png")
    return [out / "report.md", out / "results.json", out / "plot.png"]
