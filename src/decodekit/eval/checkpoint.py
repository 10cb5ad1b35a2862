"""An evaluation's checkpoint: the records so far, rewritten atomically after every item, so that
``decodekit eval --resume`` continues an interrupted run where it stopped.

Item ``i`` is decoded with its own seed (``item_seed``) whatever ran before it, so a resumed run's
records are those one uninterrupted run gives. A checkpoint is taken only by a run with the same code,
task items and settings (``resume_key``); ``--limit`` may grow (the items past the old limit run) or
shrink (the saved records past it stay in the checkpoint for a later run). A checkpoint edited or
damaged after it was written fails its digest and is refused, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidParameter
from .tasks import Task

CHECKPOINT = "checkpoint.json"
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


def digest(progress: Progress) -> str:
    """SHA-256 of the saved records and time as JSON: what an edit or damage after saving changes."""
    text = json.dumps([progress.time_s, {str(i): r for i, r in progress.records.items()}], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def save(out: Path, key: dict[str, Any], progress: Progress) -> None:
    """Write the checkpoint atomically: an interrupted run loses at most the item it was on."""
    from ..bench.results import code_version

    out.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "code": code_version(), "resume_key": key, "digest": digest(progress),
           "time_s": progress.time_s, "records": {str(i): r for i, r in sorted(progress.records.items())}}
    tmp = out / (CHECKPOINT + ".tmp")
    tmp.write_text(json.dumps(doc, ensure_ascii=False))
    os.replace(tmp, out / CHECKPOINT)


def load(out: Path, key: dict[str, Any], task: Task) -> Progress:
    """The progress saved in ``out`` by a run with this code and ``key``; anything else is a one-line
    error (read before the model loads)."""
    from ..bench.results import code_version, read_document

    path = out / CHECKPOINT
    if not path.is_file():
        raise InvalidParameter(f"--resume: no {CHECKPOINT} in {str(out)!r}; run without --resume first")
    saved = read_document(path, SCHEMA, "decodekit eval checkpoint", prefix="--resume: ")
    if saved.get("code") != code_version():
        raise InvalidParameter(f"--resume: {path} was written by decodekit {saved.get('code')}, this is {code_version()}; "
                               "run without --resume")
    saved_key = saved.get("resume_key")
    if saved_key != key:
        differ = sorted(k for k in key if not isinstance(saved_key, dict) or saved_key.get(k) != key[k])
        what = "the task's items have changed" if differ == ["items_sha256"] else f"other settings ({', '.join(differ)})"
        raise InvalidParameter(f"--resume: {path} was made with {what}; run without --resume")
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
    if saved.get("digest") != digest(progress):
        raise InvalidParameter(f"--resume: {path} has been changed since decodekit wrote it (its records do not match "
                               "their digest); run without --resume")
    return progress
