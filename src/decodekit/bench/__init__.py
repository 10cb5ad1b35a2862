"""``decodekit bench``: a Spec-Bench-style speed benchmark of decoding methods.

Spec-Bench (Xia et al., 2024, "Unlocking Efficiency in Large Language Model Inference: A
Comprehensive Survey of Speculative Decoding") times speculative methods against plain greedy
decoding on the same model over six task categories. Here every registered decodekit method
runs next to decodekit greedy (the reference for speedup and exactness), transformers
``generate()`` (plain and prompt lookup) and, when installed, llama.cpp, interleaved question
by question. The results.json schema is documented in :mod:`decodekit.bench.results`. The names
below are imported on first use (:mod:`decodekit.exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import lazy_exports

_EXPORTS = {
    "BASELINES": ".baselines", "HFGenerate": ".baselines", "LlamaCpp": ".baselines", "build_baselines": ".baselines",
    "Contestant": ".contestants", "MethodContestant": ".contestants", "RunResult": ".contestants",
    "DEFAULT_QUESTIONS": ".questions", "Question": ".questions", "category_group": ".questions",
    "load_questions": ".questions", "resolve_question_file": ".questions",
    "compare": ".report", "markdown_report": ".report", "terminal_report": ".report",
    "SCHEMA": ".results", "build_results": ".results", "load_results": ".results", "machine_info": ".results",
    "summarize": ".results",
    "BenchConfig": ".runner", "BenchRun": ".runner", "run_bench": ".runner", "schedule": ".runner",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .baselines import BASELINES, HFGenerate, LlamaCpp, build_baselines
    from .contestants import Contestant, MethodContestant, RunResult
    from .questions import DEFAULT_QUESTIONS, Question, category_group, load_questions, resolve_question_file
    from .report import compare, markdown_report, terminal_report
    from .results import SCHEMA, build_results, load_results, machine_info, summarize
    from .runner import BenchConfig, BenchRun, run_bench, schedule
