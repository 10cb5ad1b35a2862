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
from ..options import is_count, is_finite_number, is_measure
from .tasks import Task

SCHEMA = "decodekit-eval-checkpoint/2"  # /2: each item's seconds, not the run's
#: The fields every saved record has (runner.run_item), checked when a checkpoint is read.
RECORD_KEYS = ("id", "output", "answer", "correct", "tokens_spent", "signal_tokens", "time_s", "signals")


def well_typed(record: dict[str, Any]) -> bool:
    """Whether a saved record's fields are of the types a run writes (:func:`.runner.run_item`): an
    edited one is refused, not summed into a wrong accuracy or a traceback."""
    candidates = record.get("candidates", [])
    return (isinstance(record["correct"], bool) and isinstance(record["output"], str)
            and (record["answer"] is None or isinstance(record["answer"], str))
            and is_count(record["tokens_spent"]) and is_count(record["signal_tokens"])
            and is_measure(record["time_s"])
            and isinstance(record["signals"], dict)
            and all(isinstance(k, str) and (v is None or is_finite_number(v)) for k, v in record["signals"].items())
            and isinstance(candidates, list)
            and all(isinstance(c, dict) and isinstance(c.get("correct"), bool) and "answer" in c for c in candidates))


@dataclass
class Progress:
    """Records by item index, and the wall seconds each item added to the run that made it (on a
    cluster, where items run side by side, the time since the item before it arrived): a resumed run
    that asks fewer items than its checkpoint holds reports those items' time alone."""

    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    def add(self, index: int, record: dict[str, Any], seconds: float) -> None:
        self.records[index], self.seconds[index] = record, seconds

    def time_s(self, count: int) -> float:
        """The wall seconds of items 0 to ``count`` - 1."""
        return sum(s for i, s in self.seconds.items() if i < count)


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
    seconds = {str(i): s for i, s in sorted(progress.seconds.items())}
    checkpoint.save(out, SCHEMA, key, {"records": records, "seconds": seconds})


def load(out: Path, key: dict[str, Any], task: Task) -> Progress:
    """The progress saved in ``out`` by a run with this code and ``key``; anything else is a one-line
    error (read before the model loads)."""
    path, saved = checkpoint.load(out, SCHEMA, "decodekit eval checkpoint", key, input_key="items_sha256",
                                  input_changed="the task's items have changed")
    records, seconds = saved.get("records"), saved.get("seconds")
    if not isinstance(records, dict) or not isinstance(seconds, dict) or seconds.keys() != records.keys():
        raise InvalidParameter(f"--resume: {path}: records and seconds must be objects of the same items; "
                               "run without --resume")
    progress = Progress()
    for name, record in records.items():
        index = int(name) if name.isascii() and name.isdigit() else -1  # ("²".isdigit(), and int() refuses it)
        if not (0 <= index < len(task.items) and isinstance(record, dict) and all(k in record for k in RECORD_KEYS)
                and record["id"] == task.items[index].id):
            raise InvalidParameter(f"--resume: {path}: record {name!r} is not item {name}'s; run without --resume")
        if not well_typed(record):
            raise InvalidParameter(f"--resume: {path}: record {name!r} has a field of the wrong type or out of range "
                                   "(edited by hand?); run without --resume")
        time_s = seconds[name]
        if not is_measure(time_s):
            raise InvalidParameter(f"--resume: {path}: item {name}'s seconds must be a number >= 0; run without --resume")
        progress.add(index, record, float(time_s))
    return progress
