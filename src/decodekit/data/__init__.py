"""Data shipped inside the package, found through the package (never a path relative to a checkout).

* ``specbench/questions.dev.jsonl``: 240 Spec-Bench questions (Xia et al., 2024), half of each
  category; the default question file of ``decodekit bench``. Apache-2.0, ``specbench/LICENSE``.
* ``gsm8k/test.dev.jsonl``: 660 GSM8K test problems (Cobbe et al., 2021); the default data of
  ``decodekit eval gsm8k``. MIT, ``gsm8k/LICENSE``.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

SPEC_BENCH_QUESTIONS = "specbench/questions.dev.jsonl"
GSM8K_TEST = "gsm8k/test.dev.jsonl"


def data_file(name: str) -> Path:
    """The path of a shipped data file (the package is installed as a folder, so it is a real file)."""
    return Path(str(files(__name__).joinpath(name)))
