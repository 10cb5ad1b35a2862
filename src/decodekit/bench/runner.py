"""The measurement loop: warm up every contestant, then run them interleaved question by question.

Fairness rules (Spec-Bench style, adapted to one shared CPU):
* one warm-up generation per contestant before any timing (a prompt that is not a question);
* for each question, every contestant runs once, in an order rotated by one position from one
  question to the next and from one repeat to the next, so slow drift of the machine hits all
  contestants alike; garbage is collected before each timed run, not during it;
* ``repeats`` passes over the questions, each from the same start (every contestant forgets what
  it learnt across requests and is warmed up again); the summary takes medians over repeats.
A run can be checkpointed after every question and resumed: questions are the unit, so every
finished question keeps all its contestants' records from the same interleaved pass.
Each run yields one record (see :mod:`decodekit.bench.results` for the schema).
"""

from __future__ import annotations

import gc
import resource
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidParameter
from ..options import check_int, is_count, is_measure
from .contestants import WARMUP_PROMPT, Contestant, RunResult
from .questions import Question

PromptIds = Callable[[list[dict[str, str]]], list[int]]


@dataclass
class BenchConfig:
    max_new_tokens: int = 256
    repeats: int = 1
    all_turns: bool = False  # feed every turn (each contestant sees its own earlier answers); default: first turn only
    warmup_tokens: int = 32
    reference: str = "greedy"

    def validate(self) -> None:
        for name in ("max_new_tokens", "repeats", "warmup_tokens"):
            check_int(name.replace("_", "-"), getattr(self, name))


@dataclass
class BenchRun:
    records: list[dict[str, Any]]
    peak_rss_mb: dict[str, float]
    notes: list[str] = field(default_factory=list)
    contestants: list[dict[str, Any]] = field(default_factory=list)
    resumed: int = 0  # questions (x repeats) taken from an earlier run instead of being run


def rotation(names: Sequence[str], question_index: int, repeat: int) -> list[str]:
    """The order of a question's runs: rotated by one at every question, and by one more at every
    repeat (so no contestant holds the same place on a question in every repeat, whatever the
    number of questions)."""
    k = (question_index + repeat) % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def schedule(names: Sequence[str], n_questions: int, repeats: int) -> Iterator[tuple[int, int, list[str]]]:
    """Yield ``(repeat, question index, order)`` for every run of a benchmark, repeat by repeat."""
    for r in range(repeats):
        for q in range(n_questions):
            yield r, q, rotation(names, q, r)


def peak_rss_mb() -> float:
    """This process's resident-set high-water mark (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)


class Progress:
    """tqdm when installed, else a one-line stderr counter; silent when disabled."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self.bar = total, 0, enabled, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True, desc="bench")
            except ImportError:
                pass

    def update(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.enabled:
            print(f"\rbench {self.done}/{self.total} {label:<40}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def freeze_what_exists() -> None:
    """Collect garbage, then move every surviving object (the model, the libraries, the caller's
    own) out of the collector's sight. A full collection walks every object of the process: with
    torch loaded, a tenth of a second or more, and the bench collects before each of its hundreds
    of runs. After this, those collections walk only what the bench made since. Objects made
    before the bench that become cyclic garbage during it wait for :func:`gc.unfreeze`."""
    gc.collect()
    gc.freeze()


@contextmanager
def collector_frozen_for_the_bench() -> Iterator[None]:
    """:func:`freeze_what_exists` for the duration, then the frozen objects collectable again;
    except where the caller had frozen objects of its own (a server that froze what it made at
    start-up, a test suite): unfreezing would hand those back to the collector too (``gc`` can
    only unfreeze everything), so then what the bench froze stays frozen with them."""
    callers_own = gc.get_freeze_count() > 0
    freeze_what_exists()
    try:
        yield
    finally:
        if not callers_own:
            gc.unfreeze()


@contextmanager
def quiet_collector() -> Iterator[None]:
    """As ``timeit`` does: collect garbage before a timed run and not during it, so that a pause
    to collect what another contestant left (transformers allocates many objects) is not
    charged to whichever run it happens to fall in."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def run_turns(contestant: Contestant, question: Question, prompt_ids: PromptIds, config: BenchConfig) -> list[tuple[int, RunResult]]:
    """Run a question's turns (first only unless ``all_turns``); the contestant's answers become the history."""
    messages: list[dict[str, str]] = []
    results = []
    for turn in question.turns if config.all_turns else question.turns[:1]:
        messages.append({"role": "user", "content": turn})
        ids = prompt_ids(messages)
        with quiet_collector():
            result = contestant.run(ids, config.max_new_tokens)
        results.append((len(ids), result))
        messages.append({"role": "assistant", "content": result.text})
    return results


def rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


#: The keys of every record (:func:`make_record`); a record read back from a checkpoint must have them.
RECORD_FIELDS = frozenset({
    "method", "kind", "family", "lossless", "question_id", "category", "group", "repeat", "position", "turns",
    "prompt_tokens", "new_tokens", "prefill_s", "decode_s", "forward_passes", "decode_tps", "e2e_tps",
    "mean_accepted", "verifications", "finish_reason", "identical_to_reference", "text_match", "text_prefix_share",
    "texts", "tokens", "extra", "error",
})


def _optional(value: Any, check: Callable[[Any], bool]) -> bool:
    return value is None or check(value)


def is_record(rec: Any) -> bool:
    """Whether ``rec`` has the shape of a record (every field of its type, as :func:`make_record`
    writes it: a checkpoint edited by hand is refused, not summed into a traceback or a report)."""
    return (isinstance(rec, dict) and RECORD_FIELDS <= rec.keys()
            and all(isinstance(rec[k], str) for k in ("method", "kind", "family", "category", "group"))
            and is_count(rec["repeat"]) and isinstance(rec["question_id"], (int, str))
            and isinstance(rec["texts"], list) and all(isinstance(text, str) for text in rec["texts"])
            and isinstance(rec["tokens"], list)
            and all(isinstance(ids, list) and all(is_count(t) for t in ids) for ids in rec["tokens"])
            and all(is_count(rec[k]) for k in ("position", "turns", "prompt_tokens", "new_tokens"))
            and all(is_measure(rec[k]) for k in ("prefill_s", "decode_s"))
            and all(_optional(rec[k], is_count) for k in ("forward_passes", "verifications"))
            and all(_optional(rec[k], is_measure) for k in ("decode_tps", "e2e_tps", "mean_accepted", "text_prefix_share"))
            and all(_optional(rec[k], lambda v: isinstance(v, bool))  # (lossless: None for a peer such as llama.cpp)
                    for k in ("lossless", "identical_to_reference", "text_match"))
            and all(_optional(rec[k], lambda v: isinstance(v, str)) for k in ("finish_reason", "error"))
            and isinstance(rec["extra"], dict))


def per_verification(figures: Sequence[tuple[float | None, int | None]]) -> tuple[float | None, int | None]:
    """Tokens per verification over every verification of the parts (turns, questions) that report a
    figure, and how many verifications: Spec-Bench's mean accepted tokens averages over every step, so
    a part verified often weighs more. Where a part has no count (a file from before counts were
    kept), or none was verified, the mean of the parts' figures."""
    reported = [(accepted, n) for accepted, n in figures if accepted is not None]
    if not reported:
        return None, None
    total = None if any(not isinstance(n, int) for _, n in reported) else sum(n for _, n in reported)
    if not total:
        return statistics.fmean(accepted for accepted, _ in reported), total
    return sum(accepted * n for accepted, n in reported) / total, total


def make_record(contestant: Contestant, question: Question, repeat: int, position: int,
                turns: list[tuple[int, RunResult]] | None, error: str | None = None) -> dict[str, Any]:
    """One record: figures summed over the turns that ran."""
    results = [r for _, r in turns or []]
    new = sum(len(r.tokens) for r in results)
    prefill = sum(r.prefill_s for r in results)
    decode = sum(r.decode_s for r in results)
    passes = [r.forward_passes for r in results]
    accepted, verifications = per_verification([(r.mean_accepted, r.extra.get("verifications")) for r in results])
    return {
        "method": contestant.name, "kind": contestant.kind, "family": contestant.family, "lossless": contestant.lossless,
        "question_id": question.question_id, "category": question.category, "group": question.group,
        "repeat": repeat, "position": position, "turns": len(results),
        "prompt_tokens": sum(n for n, _ in turns or []),
        "new_tokens": new, "prefill_s": prefill, "decode_s": decode,
        "forward_passes": sum(passes) if results and None not in passes else None,
        "decode_tps": rate(new, decode), "e2e_tps": rate(new, prefill + decode),
        "mean_accepted": accepted, "verifications": verifications,
        "finish_reason": results[-1].finish_reason if results else None,
        "identical_to_reference": None, "text_match": None, "text_prefix_share": None,
        "texts": [r.text for r in results], "tokens": [r.tokens for r in results],
        "extra": results[-1].extra if results else {}, "error": error,
    }


def common_prefix_share(text: str, reference: str) -> float:
    """Share of the reference text that ``text`` reproduces from the start (1.0 = all of it)."""
    if not reference:
        return 1.0 if not text else 0.0
    n = 0
    for a, b in zip(text, reference):
        if a != b:
            break
        n += 1
    return n / len(reference)


def compare_to_reference(records: list[dict[str, Any]], reference: str, token_exact: dict[str, bool]) -> None:
    """Fill the exactness fields of one question's records against the reference method's record."""
    ref = next((r for r in records if r["method"] == reference and r["error"] is None), None)
    if ref is None:
        return
    ref_text = "\n".join(ref["texts"]).strip()
    for rec in records:
        if rec["error"] is not None:
            continue
        text = "\n".join(rec["texts"]).strip()
        rec["text_match"] = text == ref_text
        rec["text_prefix_share"] = round(common_prefix_share(text, ref_text), 4)
        if token_exact.get(rec["method"], False):
            rec["identical_to_reference"] = rec["tokens"] == ref["tokens"]


def warm_up(contestants: list[Contestant], prompt_ids: PromptIds, config: BenchConfig,
            notes: list[str]) -> tuple[list[Contestant], dict[str, float]]:
    """One untimed generation each; a contestant that fails here is dropped (the reference may not fail)."""
    ids = prompt_ids([{"role": "user", "content": WARMUP_PROMPT}])
    kept, rss = [], {}
    for c in contestants:
        try:
            c.run(ids, min(config.warmup_tokens, config.max_new_tokens))
        except Exception as err:  # a broken method must not sink the whole benchmark
            if c.name == config.reference:
                raise
            notes.append(f"{c.name} failed in warm-up and was skipped: {type(err).__name__}: {err}")
            continue
        kept.append(c)
        rss[c.name] = peak_rss_mb()
    return kept, rss


def finished_records(previous: Iterable[dict[str, Any]], names: Sequence[str], questions: Sequence[Question],
                     repeats: int) -> dict[tuple[int, Any], list[dict[str, Any]]]:
    """Records of an earlier (interrupted) run grouped by (repeat, question id), keeping only the
    questions and repeats of this run on which every contestant of this run has a record."""
    wanted = {q.question_id for q in questions}
    groups: dict[tuple[int, Any], list[dict[str, Any]]] = {}
    for rec in previous:
        if rec.get("question_id") in wanted and rec.get("method") in names and rec.get("repeat") in range(repeats):
            groups.setdefault((rec["repeat"], rec["question_id"]), []).append(rec)
    return {key: recs for key, recs in groups.items() if {r["method"] for r in recs} == set(names)}


class BenchSession:
    """The contestants of one machine, warmed up, answering one question at a time: the unit of a
    run, whether the questions go one after another here or to the workers of a cluster
    (:mod:`decodekit.bench.distributed`). Every contestant of a question runs here, interleaved."""

    def __init__(self, contestants: Sequence[Contestant], prompt_ids: PromptIds, config: BenchConfig) -> None:
        config.validate()
        names = [c.name for c in contestants]
        if config.reference not in names:
            raise InvalidParameter(f"the reference method {config.reference!r} must be among the contestants")
        if len(set(names)) != len(names):
            raise InvalidParameter(f"contestant names must be unique, got {', '.join(names)}")
        self.prompt_ids, self.config = prompt_ids, config
        self.notes: list[str] = []
        self.kept, self.peak_rss_mb = warm_up(list(contestants), prompt_ids, config, self.notes)
        self.names = [c.name for c in self.kept]
        self.current: int | None = None  # the repeat being run: the contestants start each one afresh

    def run_question(self, repeat: int, question_index: int, question: Question,
                     on_run: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
        """Every contestant once on ``question``, in the rotated order; records compared to the reference."""
        if self.current is not None and repeat != self.current:
            restart(self.kept, self.prompt_ids, self.config, self.notes)
        self.current = repeat
        by_name = {c.name: c for c in self.kept}
        batch = []
        for position, name in enumerate(rotation(self.names, question_index, repeat)):
            batch.append(run_one(by_name[name], question, self.prompt_ids, self.config, repeat, position, self.notes))
            if on_run is not None:
                on_run(name)
        compare_to_reference(batch, self.config.reference, {c.name: c.token_exact for c in self.kept})
        return batch

    def describe(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.kept]


def run_bench(contestants: Sequence[Contestant], questions: Sequence[Question], prompt_ids: PromptIds,
              config: BenchConfig, *, progress: bool = True, previous: Iterable[dict[str, Any]] = (),
              checkpoint: Callable[[list[dict[str, Any]]], None] | None = None) -> BenchRun:
    """Warm up, then run every contestant on every question ``repeats`` times, interleaved.

    ``previous``: records of an interrupted run of the same benchmark; questions they complete
    are not run again. ``checkpoint(records)`` is called after every question with all records
    so far (for saving them, so that an interrupted run can be resumed)."""
    if not questions:
        raise InvalidParameter("no questions to run")
    with collector_frozen_for_the_bench():
        return _run_bench(contestants, questions, prompt_ids, config, progress, previous, checkpoint)


def _run_bench(contestants: Sequence[Contestant], questions: Sequence[Question], prompt_ids: PromptIds,
               config: BenchConfig, progress: bool, previous: Iterable[dict[str, Any]],
               checkpoint: Callable[[list[dict[str, Any]]], None] | None) -> BenchRun:
    session = BenchSession(contestants, prompt_ids, config)
    done = finished_records(previous, session.names, questions, config.repeats)
    records: list[dict[str, Any]] = [rec for recs in done.values() for rec in recs]
    bar = Progress((config.repeats * len(questions) - len(done)) * len(session.names), progress)
    try:
        for repeat, qi, _ in schedule(session.names, len(questions), config.repeats):
            question = questions[qi]
            if (repeat, question.question_id) in done:
                continue
            label = f"{question.category} #{question.question_id}"
            records.extend(session.run_question(repeat, qi, question, lambda name: bar.update(f"{name} · {label}")))
            if checkpoint is not None:
                checkpoint(records)
    finally:
        bar.close()
    return BenchRun(records, session.peak_rss_mb, session.notes, session.describe(), resumed=len(done))


def restart(contestants: Sequence[Contestant], prompt_ids: PromptIds, config: BenchConfig, notes: list[str]) -> None:
    """Before each repeat after the first, every contestant forgets what it learnt across requests
    and is warmed up again: a repeat asks the same questions, and a method that remembers its
    earlier answers (a suffix corpus) would otherwise draft them; this way every repeat measures
    the same thing, from the same start."""
    ids = prompt_ids([{"role": "user", "content": WARMUP_PROMPT}])
    for c in contestants:
        try:
            c.fresh()
            c.run(ids, min(config.warmup_tokens, config.max_new_tokens))
        except Exception as err:  # the others still run; the note says this one did not start afresh
            notes.append(f"{c.name} failed in a repeat's warm-up: {type(err).__name__}: {err} "
                         "(its runs in that repeat continue from the previous repeat's state)")


def run_one(contestant: Contestant, question: Question, prompt_ids: PromptIds, config: BenchConfig,
            repeat: int, position: int, notes: list[str]) -> dict[str, Any]:
    try:
        turns = run_turns(contestant, question, prompt_ids, config)
    except Exception as err:  # recorded and reported; the other contestants still run
        message = f"{type(err).__name__}: {err}"
        notes.append(f"{contestant.name} failed on question {question.question_id}: {message}")
        return make_record(contestant, question, repeat, position, None, message)
    return make_record(contestant, question, repeat, position, turns)
