"""``decodekit eval --ray``: an evaluation's items spread over the workers of a Ray cluster.

The unit is one item. Item ``i`` is decoded with the same seed wherever it runs (``item_seed``), so every
output, answer and signal is the one a single-machine run gives; only the per-item times come from
different machines. Each worker loads the model and builds the method's decoder once. The merged
``results.json`` has the single-machine fields plus ``machines``, one entry per worker.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from ..cluster import Pool, PoolSettings, connected, parse_address
from ..models import LoadedModel
from .checkpoint import Progress
from .runner import EvalConfig, item_count, item_seed, make_decoder, run_item, summarize
from .tasks import Task

ModelRecipe = Callable[[], LoadedModel]
MACHINE_KEYS = ("host", "pid", "threads", "lost", "usable_cores", "platform", "model")


class EvalWorker:
    """One worker's side: the model and the method's decoder; runs one item per call."""

    def __init__(self, load: ModelRecipe, task: Task, config: EvalConfig) -> None:
        self.model, self.task, self.config = load(), task, config
        self.decoder = make_decoder(config, task)
        self.max_new = config.max_new_tokens or task.max_new_tokens

    def describe(self) -> dict[str, Any]:
        return {"model": self.model.name}

    def run(self, index: int) -> dict[str, Any]:
        item = self.task.items[index]
        return run_item(self.model, self.task, self.config, self.decoder, item, item_seed(self.config, index), self.max_new)


def evaluate_on_ray(load: ModelRecipe, task: Task, config: EvalConfig, address: str | None, settings: PoolSettings,
                    progress: Callable[[int, int, dict[str, Any]], None] | None = None, *,
                    resumed: Progress | None = None, checkpoint: Callable[[Progress], None] | None = None) -> dict[str, Any]:
    """:func:`decodekit.eval.runner.evaluate` on a Ray cluster (the items ``resumed`` holds are not
    sent); the summary gains ``machines``."""
    make_decoder(config, task)  # a bad method or option: the one-line error before any worker starts
    count = item_count(task, config)
    done = resumed or Progress()
    todo = {i: i for i in range(count) if i not in done.records}
    last = 0.0  # when the item before arrived

    def arrived(index: Any, record: dict[str, Any]) -> None:
        nonlocal last
        now = time.perf_counter()
        done.add(index, record, now - last)  # the cluster's wall time, shared out: its items ran side by side
        last = now
        if checkpoint:
            checkpoint(done)
        if progress:
            progress(sum(i < count for i in done.records), count, record)

    with connected(parse_address(address)) as ray:
        pool = Pool(ray, functools.partial(EvalWorker, load, task, config), settings)
        last = time.perf_counter()  # as on one machine: the items' time, not the workers' start-up
        try:
            pool.map(todo, arrived)
        finally:
            pool.close()
    result = summarize(task, config, [done.records[i] for i in range(count)], done.time_s(count))
    result["machines"] = [{**{k: d[k] for k in MACHINE_KEYS}, "units": len(d["done"]), "items": sorted(d["done"])}
                          for d in pool.descriptions]
    return result
