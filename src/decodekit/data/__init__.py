"""Data shipped inside the package, found through the package (never a path relative to a checkout).

* ``specbench/questions.dev.jsonl``: 240 Spec-Bench questions (Xia et al., 2024), half of each
  category; the default question file of ``decodekit bench``. Apache-2.0, ``specbench/LICENSE``.
* ``gsm8k/test.dev.jsonl``: 660 GSM8K test problems (Cobbe et al., 2021); the default data of
  ``decodekit eval gsm8k``. MIT, ``gsm8k/LICENSE``.
* ``structured/schemas.jsonl``: the corpus of ``decodekit eval structured``: 68 JSON Schemas adapted
  from the JSON-Schema-Test-Suite (draft 2020-12; MIT, ``structured/LICENSE``; schemas only, with
  prompts written here, so not the Test Suite itself) and 10 application schemas written here, built
  by ``scripts/build_structured_corpus.py``.
* ``drafters/smollm2-135m-{eagle,medusa,hydra}.safetensors``: the trained drafters of the embedded model,
  made by ``decodekit train-drafter`` from the model's own outputs (``drafters/README.md``).
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable
from importlib.resources import files
from pathlib import Path
from typing import Any

from ..errors import InvalidParameter

SPEC_BENCH_QUESTIONS = "specbench/questions.dev.jsonl"
GSM8K_TEST = "gsm8k/test.dev.jsonl"
STRUCTURED_SCHEMAS = "structured/schemas.jsonl"


def data_file(name: str) -> Path:
    """The path of a shipped data file (the package is installed as a folder, so it is a real file)."""
    return Path(str(files(__name__).joinpath(name)))


def read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The objects of a UTF-8 JSON Lines file, each with ``"PATH:LINE"`` for error messages; blank
    lines are skipped. Undecodable bytes, bad JSON, a line that is not an object or a string escaping
    half a character (a lone surrogate such as ``"\\udc80"``, which no text holds): one-line errors.
    Lines end at ``\n`` alone, as JSON Lines says: U+2028 and the like may stand in a JSON string."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise InvalidParameter(f"{path}:{line}: not valid UTF-8 (byte {data[err.start]:#04x})") from None
    rows = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidParameter(f"{where}: not valid JSON ({err.msg})") from None
        except RecursionError:  # json's reader recurses: a line of [[[[... thousands deep
            raise InvalidParameter(f"{where}: JSON nested too deeply") from None
        if not isinstance(row, dict):
            raise InvalidParameter(f"{where}: expected a JSON object, got {type(row).__name__}")
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidParameter(f"{where}: a string escapes half a character ({err.object[err.start]!r}), "
                                   "which is no text") from None
        rows.append((where, row))
    return rows


def first_repeated(ids: Iterable[Hashable]) -> Hashable | None:
    """The first id that appears a second time, or None: records, checkpoints and reports are
    keyed by id, so a repeated one would mix two items' results."""
    seen: set[Hashable] = set()
    for each in ids:
        if each in seen:
            return each
        seen.add(each)
    return None
