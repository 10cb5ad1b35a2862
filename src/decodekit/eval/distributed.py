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
from .runner import EvalConfig, item_seed, make_decoder, run_item, summarize
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
                    progress: Callable[[int, int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """:func:`decodekit.eval.runner.evaluate` on a Ray cluster; the summary gains ``machines``."""
    make_decoder(config, task)  # a bad method or option: the one-line error before any worker starts
    count = min(len(task.items), config.limit) if config.limit else len(task.items)
    records: dict[int, dict[str, Any]] = {}

    def arrived(index: Any, record: dict[str, Any]) -> None:
        records[index] = record
        if progress:
            progress(len(records), count, record)

    with connected(parse_address(address)) as ray:
        pool = Pool(ray, functools.partial(EvalWorker, load, task, config), settings)
        start = time.perf_counter()  # as on one machine: the items' time, not the workers' start-up
        try:
            pool.map({i: i for i in range(count)}, arrived)
        finally:
            pool.close()
        elapsed = time.perf_counter() - start
    result = summarize(task, config, [records[i] for i in range(count)], elapsed)
    result["machines"] = [{**{k: d[k] for k in MACHINE_KEYS}, "units": len(d["done"]), "items": sorted(d["done"])}
                          for d in pool.descriptions]
    return result
