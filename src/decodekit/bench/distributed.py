"""``decodekit bench --ray``: the same benchmark, its questions spread over the workers of a Ray cluster.

The unit is one question of one repeat, as in a single-machine run's checkpoints: a worker runs
every contestant on it, interleaved in the same rotated order, so every ratio still compares
contestants measured side by side on one machine. Each worker loads the model once, builds the
contestants as a single-machine run does and warms them up, and starts each repeat afresh as one
does. Records stream back into the same checkpoint after every question, so ``--resume`` works
after a lost worker or a lost driver; the merged ``results.json`` has the single-machine schema
plus ``machines``, one entry per worker.

What differs from one machine: the questions a worker did not run are not in its contestants'
cross-request memory (a suffix corpus), and each worker's timings come from its own machine. Both
change timings, never tokens: every contestant compared for exactness is lossless.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..cluster import Pool, PoolSettings, connected, parse_address
from ..models import LoadedModel
from .execution import Plan, bench_config, build_contestants, finish, save_checkpoint
from .results import merged_notes
from .runner import BenchRun, BenchSession, Progress, finished_records, freeze_what_exists

ModelRecipe = Callable[[], LoadedModel]  # loads the model inside a worker (a picklable callable)


class BenchWorker:
    """One worker's side: the model, the plan's contestants, warmed up; runs one question per call."""

    def __init__(self, plan: Plan, load: ModelRecipe) -> None:
        from .results import code_version, machine_info

        model = load()
        freeze_what_exists()  # for the worker's life: the frozen objects (the model) live as long
        contestants, self.notes = build_contestants(plan, model)
        self.session = BenchSession(contestants, model.prompt_ids, bench_config(plan))
        self.machine = machine_info(model=model.name, dtype=plan.dtype, numerics=plan.numerics)
        self.code = code_version()

    def describe(self) -> dict[str, Any]:
        return {"machine": self.machine, "contestants": self.session.describe(), "code": self.code,
                "peak_rss_mb": self.session.peak_rss_mb, "notes": [*self.notes, *self.session.notes]}

    def run(self, unit: tuple[int, int, Any]) -> dict[str, Any]:
        """``unit``: (repeat, question index, question); returns its records and the notes it added."""
        repeat, index, question = unit
        before = len(self.session.notes)
        records = self.session.run_question(repeat, index, question)
        return {"records": records, "notes": self.session.notes[before:]}


def model_recipe(plan: Plan) -> ModelRecipe:
    from ..models import load_model

    return functools.partial(load_model, plan.model, dtype=plan.dtype, numerics=plan.numerics)


def machine_entry(description: dict[str, Any], questions: Sequence[Any]) -> dict[str, Any]:
    """A worker in results.json: where it ran, and which questions (``[repeat, question_id]``) it ran."""
    ran = [[repeat, questions[index].question_id] for repeat, index in description["done"]]
    return {"host": description["host"], "pid": description["pid"], "threads": description["threads"],
            "units": len(ran), "questions": ran, "lost": description["lost"], "machine": description["machine"]}


def execute_on_ray(plan: Plan, address: str | None, settings: PoolSettings, *, load: ModelRecipe | None = None,
                   progress: bool = True) -> dict[str, Any]:
    """Run the plan on a Ray cluster (``address`` as in :func:`decodekit.cluster.connected`); write
    and return the same results as :func:`decodekit.bench.execution.execute`, plus ``machines``."""
    from .results import code_version

    code = code_version()
    with connected(parse_address(address)) as ray:
        sent = dataclasses.replace(plan, previous=[], previous_notes=[])  # workers need the settings, not the records
        pool = Pool(ray, functools.partial(BenchWorker, sent, load or model_recipe(plan)), settings)
        try:
            return _run(plan, pool, code, progress)
        finally:
            pool.close()


def _run(plan: Plan, pool: Pool, code: str, progress: bool) -> dict[str, Any]:
    first = pool.descriptions[0]
    names = [c["name"] for c in first["contestants"]]
    notes = merged_notes(plan.notes, (n for d in pool.descriptions for n in d["notes"]), plan.previous_notes)
    if any(d["code"] != code for d in pool.descriptions):
        notes.append("some workers run other decodekit code than the driver: "
                     + ", ".join(sorted({d["code"] for d in pool.descriptions})))
    if any([c["name"] for c in d["contestants"]] != names for d in pool.descriptions):
        notes.append("workers kept different contestants after their warm-up; ratios use the questions both sides ran")
    done = finished_records(plan.previous, names, plan.questions, plan.repeats)
    records = [rec for recs in done.values() for rec in recs]
    units = {(r, qi): (r, qi, q) for r in range(plan.repeats) for qi, q in enumerate(plan.questions)
             if (r, q.question_id) not in done}
    print(f"decodekit bench: {len(units)} question runs on {len(pool.descriptions)} workers", file=sys.stderr)
    bar = Progress(len(units), progress)

    def arrived(key: Any, result: dict[str, Any]) -> None:
        records.extend(result["records"])
        notes.extend(n for n in dict.fromkeys(result["notes"]) if n not in notes)  # each worker says the same
        save_checkpoint(plan, records, notes)
        repeat, qi = key
        bar.update(f"repeat {repeat} · question {plan.questions[qi].question_id}")

    try:
        pool.map(units, arrived)
    finally:
        bar.close()
    order = {(r, q.question_id): (r, qi) for r in range(plan.repeats) for qi, q in enumerate(plan.questions)}
    records.sort(key=lambda rec: (*order[rec["repeat"], rec["question_id"]], rec["position"]))  # the single-machine order
    peak: dict[str, float] = {}
    for d in pool.descriptions:
        for name, mb in d["peak_rss_mb"].items():
            peak[name] = max(peak.get(name, 0.0), mb)
    machines = [machine_entry(d, plan.questions) for d in pool.descriptions]
    run_ = BenchRun(records, peak, [], first["contestants"], resumed=len(done))
    return finish(plan, run_, notes, first["machine"], machines, lost=pool.lost)
