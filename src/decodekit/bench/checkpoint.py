"""A run's checkpoint file, shared by ``decodekit bench`` and ``decodekit eval`` (``--resume``).

The file holds what the run has measured so far (its *payload*: records, notes, ...) beside a
header: the schema, the code's version, the *resume key* (every setting a resumed run must share)
and a SHA-256 digest of the payload. It is rewritten atomically after every unit of work, so an
interrupted run loses at most the unit it was on. It is read back only by a run of the same code
and key, and a payload edited or damaged after it was written fails its digest: refused, never
trusted. What a payload's records must look like is the caller's to check.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidParameter
from .results import code_version, read_document

CHECKPOINT = "checkpoint.json"
HEADER = ("schema", "code", "resume_key", "digest")


def digest(payload: dict[str, Any]) -> str:
    """SHA-256 of the payload as JSON with sorted keys: what an edit or damage after saving changes."""
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def save(folder: Path, schema: str, key: dict[str, Any], payload: dict[str, Any]) -> None:
    """Write ``folder``/checkpoint.json atomically (a new file renamed over the old one)."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"schema": schema, "code": code_version(), "resume_key": key, "digest": digest(payload), **payload}
    tmp = folder / (CHECKPOINT + ".tmp")
    tmp.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, folder / CHECKPOINT)


def load(folder: Path, schema: str, what: str, key: dict[str, Any], *, input_key: str,
         input_changed: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint's path and payload, saved in ``folder`` by a run of this code with this ``key``;
    anything else is a one-line error. ``what`` names the file in errors; ``input_key`` is the key's
    hash of the run's input, and ``input_changed`` what to say when that alone differs (``"the
    question file 'q.jsonl' has changed"``)."""
    path = folder / CHECKPOINT
    if not path.is_file():
        raise InvalidParameter(f"--resume: no {CHECKPOINT} in {str(folder)!r}; run without --resume first")
    saved = read_document(path, schema, what, prefix="--resume: ")
    code = code_version()
    if saved.get("code") != code:
        raise InvalidParameter(f"--resume: {path} was written by decodekit {saved.get('code')}, this is {code}; "
                               "results of different code cannot be mixed, run without --resume")
    saved_key = saved.get("resume_key")
    if not isinstance(saved_key, dict):
        raise InvalidParameter(f"--resume: {path} is not a {what} (resume_key is not an object)")
    if saved_key != key:
        differ = sorted(k for k in {*key, *saved_key} if saved_key.get(k) != key.get(k))
        if differ == [input_key]:
            raise InvalidParameter(f"--resume: {input_changed} since {path} was written; run without --resume")
        raise InvalidParameter(f"--resume: {path} was made with other settings ({', '.join(differ)}); "
                               "run without --resume")
    payload = {name: value for name, value in saved.items() if name not in HEADER}
    if saved.get("digest") != digest(payload):
        raise InvalidParameter(f"--resume: {path} has been changed since decodekit wrote it (its records do not "
                               "match their digest); run without --resume")
    return path, payload
