"""An evaluation's checkpoint: the records so far, rewritten atomically after every item, so that
``decodekit eval --resume`` continues an interrupted run where it stopped.

Item ``i`` is decoded with its own seed (``item_seed``) whatever ran before it, so a resumed run's
records are those one uninterrupted run gives. A checkpoint is taken only by a run with the same code,
task items and settings (``resume_key``); ``--limit`` may grow (the items past the old limit run) or
shrink (the saved records past it stay in the checkpoint for a later run). The file, its digest and
its checks of code and settings are bench's (:mod:`decodekit.bench.checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..bench import checkpoint
from ..errors import InvalidParameter
from .tasks import Task

SCHEMA = "decodekit-eval-checkpoint/1"
#: The fields every saved record has (runner.run_item), checked when a checkpoint is read.
RECORD_KEYS = ("id", "output", "answer", "correct", "tokens_spent", "signal_tokens", "time_s", "signals")


@dataclass
class Progress:
    """Records by item index, and the seconds the runs that made them spent on items."""

    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    time_s: float = 0.0


def items_digest(task: Task) -> str:
    """SHA-256 of the task's items as asked and judged: a data file edited between runs is another task."""
    items = [[item.id, item.question, item.gold, item.subject, item.constraint] for item in task.items]
    return hashlib.sha256(json.dumps(items, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def resume_key(task: Task, settings: dict[str, Any]) -> dict[str, Any]:
    """What a resumed run must share with its checkpoint: the task's items and every setting that
    changes an item's record (``settings``: method, options, seeds, model, numerics, ...)."""
    return json.loads(json.dumps({"task": task.name, "items_sha256": items_digest(task), **settings}, default=str))


def save(out: Path, key: dict[str, Any], progress: Progress) -> None:
    """Save the records so far: an interrupted run loses at most the item it was on."""
    records = {str(i): r for i, r in sorted(progress.records.items())}
    checkpoint.save(out, SCHEMA, key, {"time_s": progress.time_s, "records": records})


def load(out: Path, key: dict[str, Any], task: Task) -> Progress:
    """The progress saved in ``out`` by a run with this code and ``key``; anything else is a one-line
    error (read before the model loads)."""
    path, saved = checkpoint.load(out, SCHEMA, "decodekit eval checkpoint", key, input_key="items_sha256",
                                  input_changed="the task's items have changed")
    records, time_s = saved.get("records"), saved.get("time_s")
    if not isinstance(records, dict) or not isinstance(time_s, (int, float)) or isinstance(time_s, bool):
        raise InvalidParameter(f"--resume: {path}: records must be an object and time_s a number; run without --resume")
    progress = Progress({}, float(time_s))
    for name, record in records.items():
        index = int(name) if name.isdigit() else -1
        if not (0 <= index < len(task.items) and isinstance(record, dict) and all(k in record for k in RECORD_KEYS)
                and record["id"] == task.items[index].id):
            raise InvalidParameter(f"--resume: {path}: record {name!r} is not item {name}'s; run without --resume")
        progress.records[index] = record
    return progress
