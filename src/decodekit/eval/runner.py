"""Run a method over a task: per-item records, accuracy, tokens, time, signal AUROCs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine import build_decoder, make_sampler, method_spec, validate_options
from ..samplers.constraint import constraint_processor
from ..engine.core import Decoder, Request
from ..errors import InvalidParameter
from ..models import LoadedModel
from ..options import check_int
from ..samplers.params import SEED_LIMIT
from ..samplers.sampler import splitmix64
from ..search import SampleDecoder, majority_vote
from ..search.uncertainty import CONFIDENCE_DIRECTION, paraphrase_consistency, sampled_agreement
from .metrics import auroc, wilson_interval
from .checkpoint import Progress
from .tasks import Task

EXTRA_SIGNALS = ("agreement", "pc")
#: Seeds between two items: an item's samples take seed, seed + 1, ..., so that no two items share
#: a sample's draws (draws are keyed by seed and position).
ITEM_SEED_SPACING = 2**32
#: Where, past an item's seed, the agreement signal's samples start: a stream of their own, never
#: the answer's (with the answer among them, agreement could not fall below 1 / n).
AGREEMENT_SEEDS = 2**31


def item_seed(config: "EvalConfig", index: int) -> int:
    """The seed item ``index`` is decoded with, wherever it runs: from a hash of the run's seed, so
    that runs with neighbouring seeds (0, 1, 2, ... to measure the spread) draw unrelated samples;
    with ``seed + index * spacing`` alone, ``--seed 1`` would reuse ``--seed 0``'s samples shifted
    by one."""
    return (splitmix64(config.seed) + index * ITEM_SEED_SPACING) % SEED_LIMIT


@dataclass
class EvalConfig:
    method: str = "greedy"
    n: int = 8
    limit: int | None = None
    max_new_tokens: int | None = None
    seed: int = 0
    temperature: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    signals: Sequence[str] = ()  # extra signals computed besides the method's own
    paraphrases: int = 4
    constrained: bool = True  # decode under an item's constraint (structured tasks); False to compare

    def __post_init__(self) -> None:
        if self.limit is not None:  # (0 would read as "no limit": every item, not none)
            check_int("limit", self.limit, 1)


def uses_n(config: EvalConfig) -> bool:
    """Whether ``--n`` counts anything in this run: the samples (beams, branches) of a method that
    takes n, or those of ``--signals agreement``; otherwise the method draws one answer."""
    return "n" in (method_spec(config.method).options or {}) or "agreement" in config.signals


def make_decoder(config: EvalConfig, task: Task) -> Decoder:
    """Plain greedy/sample go through :class:`SampleDecoder` (same tokens, plus signals); the rest
    through the registry, with ``--n`` and the task's answer extractor where the method takes them."""
    spec = method_spec(config.method)
    bad = [s for s in config.signals if s not in EXTRA_SIGNALS]
    if bad:
        raise InvalidParameter(f"unknown signal(s) {', '.join(bad)}; extra signals: {', '.join(EXTRA_SIGNALS)}")
    make_sampler(config.method, {"seed": config.seed, "temperature": config.temperature})  # e.g. greedy + temperature
    if config.n != EvalConfig.n and not uses_n(config):
        raise InvalidParameter(f"--n {config.n}: method {config.method!r} draws one answer; --n sets the samples of the "
                               f"methods that take n and of --signals agreement", param="n")
    if spec.family == "plain":
        validate_options(config.method, config.options)  # none taken
        return SampleDecoder(task.answer_start)
    return build_decoder(config.method, **method_options(config, task))


def method_options(config: EvalConfig, task: Task) -> dict[str, Any]:
    """The options the method is built with: ``--opt``'s, with ``--n`` and the task's answer extractor
    where the method takes them."""
    accepted = method_spec(config.method).options or {}
    options = dict(config.options)
    if "n" in options:  # one n: the report, the agreement signal and the budget curve read --n
        raise InvalidParameter("the number of samples is --n (EvalConfig.n), not --opt n=", param="n")
    if "n" in accepted:
        options.setdefault("n", config.n)
    if "answer" in accepted and accepted["answer"].allow_callable:
        options.setdefault("answer", task.answer)
    if "answer_start" in accepted:
        options.setdefault("answer_start", task.answer_start)
    return options


def item_count(task: Task, config: EvalConfig) -> int:
    """How many of the task's items the run evaluates (the first ``limit``)."""
    return min(len(task.items), config.limit) if config.limit else len(task.items)


def evaluate(model: LoadedModel, task: Task, config: EvalConfig,
             progress: Callable[[int, int, dict[str, Any]], None] | None = None, *,
             resumed: Progress | None = None, checkpoint: Callable[[Progress], None] | None = None) -> dict[str, Any]:
    """Every item in order; ``resumed`` holds the records of items already done (an earlier run's,
    kept and not decoded again), and ``checkpoint`` is called with the progress after each item."""
    decoder = make_decoder(config, task)
    count, max_new = item_count(task, config), config.max_new_tokens or task.max_new_tokens
    done = resumed or Progress()
    for index in range(count):
        if index in done.records:
            continue
        start = time.perf_counter()
        record = run_item(model, task, config, decoder, task.items[index], item_seed(config, index), max_new)
        done.add(index, record, time.perf_counter() - start)
        if checkpoint:
            checkpoint(done)
        if progress:
            progress(sum(i < count for i in done.records), count, record)
    return summarize(task, config, [done.records[i] for i in range(count)], done.time_s(count))


def run_item(model, task, config, decoder, item, seed, max_new) -> dict[str, Any]:
    sampler_params = {"seed": seed, "temperature": config.temperature}
    mask = None
    if item.constraint is not None and config.constrained:
        mask = constraint_processor(item.constraint, model.tokenizer)
    request = Request(model.prompt_ids(item.question), make_sampler(config.method, sampler_params, mask), max_new)
    t0 = time.perf_counter()
    gen = decoder.generate(model, request)
    answer = task.answer(gen.text)
    signals = dict(gen.extra.get("uncertainty", {}))
    spent = gen.stats.extra.get("tokens_spent", gen.stats.new_tokens)
    extra_spent = 0
    if "agreement" in config.signals and "agreement" not in signals:
        # sampled_agreement draws its samples at its own SAMPLE_TEMPERATURE, under the item's constraint
        probe_seed = (seed + AGREEMENT_SEEDS) % SEED_LIMIT
        probe = Request(request.prompt_ids, make_sampler("greedy", {"seed": probe_seed}, mask), max_new)
        found = sampled_agreement(model, probe, answer, task.answer, n=config.n)
        signals["agreement"], extra_spent = found["agreement"], extra_spent + found["tokens_spent"]
    if "pc" in config.signals:
        found = paraphrase_consistency(model, task.paraphrase(item, config.paraphrases), answer, task.answer, request)
        signals["pc"], extra_spent = found["pc"], extra_spent + found["tokens_spent"]
    gen.extra["uncertainty"] = signals
    record = {
        "id": item.id, "question": item.question, "gold": item.gold, "output": gen.text, "answer": answer,
        "correct": task.is_correct(gen.text, item), "tokens_spent": spent, "signal_tokens": extra_spent,
        "time_s": round(time.perf_counter() - t0, 3), "signals": signals,
    }
    # the samples' answers, for the budget curve; not those a method stopped mid-answer (first-finish's
    # others, cut off when the first one finished)
    candidates = [c for c in gen.extra.get("candidates") or [] if c.get("finish_reason") != "unfinished"]
    if candidates and all("answer" in c for c in candidates):
        record["candidates"] = [{"answer": c["answer"], "correct": task.is_correct(c["text"], item)} for c in candidates]
    return record


def budget_curve(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Accuracy of a majority vote over the first m samples, m = 1, 2, 4, ..., N (voting methods)."""
    sized = [r["candidates"] for r in records if r.get("candidates")]
    if len(sized) != len(records) or not records:
        return []
    n = min(len(c) for c in sized)
    sizes = sorted({m for m in (1, 2, 4, 8, 16, 32, 64) if m <= n} | {n})
    curve = []
    for m in sizes:
        right = 0
        for cands in sized:
            winner, _ = majority_vote([c["answer"] for c in cands[:m]])
            right += any(c["answer"] == winner and c["correct"] for c in cands[:m]) if winner is not None else cands[0]["correct"]
        curve.append({"samples": m, "accuracy": right / len(sized)})
    return curve


def signal_aurocs(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """AUROC of each signal, oriented so that higher = "more likely correct", over items that have it."""
    names = sorted({k for r in records for k, v in r["signals"].items() if isinstance(v, (int, float))})
    out = {}
    for name in names:
        sign = CONFIDENCE_DIRECTION.get(name, 1)
        pairs = [(sign * r["signals"][name], r["correct"]) for r in records if isinstance(r["signals"].get(name), (int, float))]
        out[name] = auroc([p[0] for p in pairs], [p[1] for p in pairs]) if pairs else None
    return out


def summarize(task: Task, config: EvalConfig, records: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    right = sum(r["correct"] for r in records)
    lo, hi = wilson_interval(right, len(records))
    return {
        # n: null where nothing used it (a greedy run draws one answer), not the default it was left at
        "task": task.name, "method": config.method, "n": config.n if uses_n(config) else None, "seed": config.seed,
        "options": {k: v for k, v in config.options.items() if not callable(v)}, "signals_requested": list(config.signals),
        "items": len(records), "correct": right, "accuracy": right / len(records) if records else 0.0,
        "ci95": [lo, hi], "tokens_spent": sum(r["tokens_spent"] for r in records),
        "signal_tokens": sum(r["signal_tokens"] for r in records), "time_s": round(elapsed, 2),
        "auroc": signal_aurocs(records), "budget_curve": budget_curve(records), "records": records,
    }
