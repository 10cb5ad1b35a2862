"""Running a benchmark plan: its contestants on a loaded model, the checkpoint after every
question (atomic, so an interrupted run can be resumed), and results.json, report.md and
speedup.png at the end. Shared by the single-machine run (:func:`execute`) and the run on a Ray
cluster (:mod:`decodekit.bench.distributed`); ``decodekit bench`` (:mod:`.cli`) builds the plan."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidParameter
from . import checkpoint
from .questions import Question
from .results import merged_notes
from .runner import BenchConfig, is_record, run_bench

REFERENCE = "greedy"


@dataclass
class Plan:
    """Everything a run needs, validated before the model is loaded."""

    methods: list[str]
    options: dict[str, dict[str, Any]]
    baselines: list[str]
    questions: list[Question]
    question_file: Path
    #: The question file's contents when the questions were read: a resumed run must read the same
    #: questions, not only the same path (a file edited while the model loads is not what ran).
    question_file_sha256: str
    max_new_tokens: int
    limit: int | None
    categories: list[str]
    repeats: int
    all_turns: bool
    model: str | None
    dtype: str
    numerics: str
    threads: int | None
    out: Path
    command: str
    notes: list[str] = field(default_factory=list)
    resume: bool = False
    previous: list[dict[str, Any]] = field(default_factory=list)  # --resume: the checkpoint's records
    previous_notes: list[str] = field(default_factory=list)
    ray: str | None = None  # --ray: "local" or a cluster address; None runs here
    workers: int | None = None

    def config(self) -> dict[str, Any]:
        return {
            "questions": str(self.question_file), "methods": self.methods, "baselines": self.baselines,
            "max_new_tokens": self.max_new_tokens, "limit": self.limit, "categories": self.categories,
            "dtype": self.dtype, "numerics": self.numerics, "model": self.model, "repeats": self.repeats, "all_turns": self.all_turns,
            "options": self.options, "reference": REFERENCE,
        }

    def resume_key(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint (the question selection may grow)."""
        key = {k: v for k, v in self.config().items() if k not in ("limit", "categories")}
        return json.loads(json.dumps({**key, "threads": self.threads, "question_file_sha256": self.question_file_sha256}))


CHECKPOINT_SCHEMA = "decodekit-bench-checkpoint/1"


def load_checkpoint(plan: Plan) -> tuple[list[dict[str, Any]], list[str]]:
    """Records and notes saved by an earlier run of ``plan`` in ``plan.out``; a missing checkpoint,
    other settings or other code is a one-line error (checked before the model loads)."""
    path, saved = checkpoint.load(plan.out, CHECKPOINT_SCHEMA, "decodekit bench checkpoint", plan.resume_key(),
                                  input_key="question_file_sha256",
                                  input_changed=f"the question file {str(plan.question_file)!r} has changed")
    records, notes = saved.get("records"), saved.get("notes")
    if not isinstance(records, list) or not isinstance(notes, list):
        raise InvalidParameter(f"--resume: {path}: records and notes must be lists; run without --resume")
    bad = next((i for i, rec in enumerate(records) if not is_record(rec)), None)
    if bad is not None:
        raise InvalidParameter(f"--resume: {path}: record {bad} is malformed; run without --resume")
    return records, [str(n) for n in notes]


def resumed_note(runs: int, repeats: int) -> str:
    """What a resumed run took over: ``runs`` runs of a question, one per question and repeat."""
    what = f"{runs} question(s)" if repeats == 1 else f"{runs} run(s) of a question (each question once per repeat)"
    return f"resumed: {what} taken from an earlier run of the same code and settings"


def save_checkpoint(plan: Plan, records: list[dict[str, Any]], notes: list[str]) -> None:
    """Save the records so far, so an interrupted run loses at most one question. The resumed
    checkpoint's records of questions this run does not ask (a smaller --limit or other
    --categories) are kept in it, for a later run that asks them again."""
    if plan.previous:
        asked = {q.question_id for q in plan.questions}
        records = [*records, *(r for r in plan.previous if r.get("question_id") not in asked)]
    checkpoint.save(plan.out, CHECKPOINT_SCHEMA, plan.resume_key(), {"notes": notes, "records": records})


def build_contestants(plan: Plan, model, *, hf_model=None) -> tuple[list, list[str]]:
    """The plan's methods and baselines on a loaded model, ready to warm up, and notes on any skipped."""
    import torch

    from ..engine import Engine
    from ..models import LoadedModel
    from ..speculative import prepare
    from .baselines import build_baselines
    from .contestants import MethodContestant

    context = model.backend.info.max_length
    if plan.max_new_tokens >= context:  # every question would fail; said once, before any runs
        raise InvalidParameter(f"--max-new-tokens {plan.max_new_tokens}: no prompt fits beside that many new tokens in "
                               f"the model's context of {context}")
    # the same for the questions' own first prompts, as the runs build them (run_turns): a bench of
    # nothing but failed runs would otherwise end with exit status 0 and a report of dashes
    shortest = min((len(model.prompt_ids([{"role": "user", "content": q.turns[0]}])) for q in plan.questions), default=0)
    if shortest + plan.max_new_tokens > context:
        raise InvalidParameter(f"--max-new-tokens {plan.max_new_tokens}: no question's prompt fits beside that many new "
                               f"tokens in the model's context of {context} (the shortest takes {shortest} tokens)")
    if plan.threads:
        torch.set_num_threads(plan.threads)
    # Each method gets its own backend clone (shared weights, own cache and own cross-request
    # memory: suffix corpus, recycling table, bandit), as if each ran in its own process as in
    # Spec-Bench; otherwise a method could draft from another method's answer to the same question.
    contestants = [
        MethodContestant(Engine(LoadedModel(model.backend.clone(), model.tokenizer, model.name)), m, plan.options.get(m))
        for m in plan.methods
    ]
    # The verify-cost table a speculative method's controller needs is measured (or read from the
    # cache) now, outside any timed region, as a model load would: not in a warm-up or a question.
    for contestant in contestants:
        if contestant.family == "speculative":
            prepare(contestant.engine.model.backend)
    baselines, notes = build_baselines(plan.baselines, model, model=plan.model, dtype=plan.dtype,
                                       threads=torch.get_num_threads(), hf_model=hf_model, numerics=plan.numerics)
    return [*contestants, *baselines], notes


def bench_config(plan: Plan) -> BenchConfig:
    return BenchConfig(max_new_tokens=plan.max_new_tokens, repeats=plan.repeats, all_turns=plan.all_turns, reference=REFERENCE)


def execute(plan: Plan, model, *, hf_model=None, progress: bool = True) -> dict[str, Any]:
    """Run the plan on a loaded model; write results.json, report.md and speedup.png; return the results."""
    from ..models.threads import GOVERNOR
    from .results import code_version, machine_info

    code_version()  # fix the code stamp of this run's checkpoints and results now
    before = GOVERNOR.passes.copy()  # (the process's passes so far are not this run's)
    contestants, notes = build_contestants(plan, model, hf_model=hf_model)
    notes = merged_notes(plan.notes, notes, plan.previous_notes)
    run_ = run_bench(contestants, plan.questions, model.prompt_ids, bench_config(plan), progress=progress,
                     previous=plan.previous, checkpoint=lambda records: save_checkpoint(plan, records, notes))
    machine = machine_info(model=model.name, dtype=plan.dtype, numerics=plan.numerics, passes=GOVERNOR.passes - before)
    return finish(plan, run_, notes, machine)


def finish(plan: Plan, run_, notes: list[str], machine: dict[str, Any], machines: list[dict[str, Any]] | None = None,
           *, lost: int = 0) -> dict[str, Any]:
    """Save the last checkpoint and write results.json, report.md and speedup.png for a finished run;
    ``machines``: the workers of a run on a Ray cluster (``lost`` of them lost on the way)."""
    from .plot import plot_speedup
    from .report import write_report
    from .results import build_results, write_results

    save_checkpoint(plan, run_.records, [*notes, *run_.notes])
    # Notes on this run only, not saved for a resumed one to repeat:
    if run_.resumed:
        notes.append(resumed_note(run_.resumed, plan.repeats))
    if machines is not None:
        notes.append(f"ran on a Ray cluster: {len(machines)} workers ({lost} lost and replaced); every question's "
                     "contestants ran side by side on one worker, so ratios are per worker; see machines")
    results = build_results(run_, command=plan.command, config=plan.config(), machine=machine, notes=notes, machines=machines)
    write_results(results, plan.out / "results.json")
    n = len(plan.questions)
    subtitle = (f"{machine['model']}, {plan.dtype}, {plan.numerics} numerics, {n} question{'s' if n != 1 else ''}, "
                f"{plan.max_new_tokens} new tokens")
    plot_speedup(results["summary"], plan.out / "speedup.png", subtitle=subtitle)
    write_report(results, plan.out / "report.md")
    return results
