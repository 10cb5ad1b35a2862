"""``decodekit bench``: a Spec-Bench-style speed benchmark of decoding methods.

Spec-Bench (Xia et al., 2024, "Unlocking Efficiency in Large Language Model Inference: A
Comprehensive Survey of Speculative Decoding") times speculative methods against plain greedy
decoding on the same model over six task categories. Here every registered decodekit method
runs next to decodekit greedy (the reference for speedup and exactness), transformers
``generate()`` (plain and prompt lookup) and, when installed, llama.cpp, interleaved question
by question. The results.json schema is documented in :mod:`decodekit.bench.results`.
"""

from .baselines import BASELINES, HFGenerate, LlamaCpp, build_baselines
from .contestants import Contestant, MethodContestant, RunResult
from .questions import DEFAULT_QUESTIONS, Question, category_group, load_questions, resolve_question_file
from .report import compare, markdown_report, terminal_report
from .results import SCHEMA, build_results, load_results, machine_info, summarize
from .runner import BenchConfig, BenchRun, run_bench, schedule

__all__ = [
    "BASELINES", "BenchConfig", "BenchRun", "Contestant", "DEFAULT_QUESTIONS", "HFGenerate", "LlamaCpp",
    "MethodContestant", "Question", "RunResult", "SCHEMA", "build_baselines", "build_results", "category_group",
    "compare", "load_questions", "load_results", "machine_info", "markdown_report", "resolve_question_file",
    "run_bench", "schedule", "summarize", "terminal_report",
]
