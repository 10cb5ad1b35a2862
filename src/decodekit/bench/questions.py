"""Spec-Bench question files: load, validate, group and select questions.

A question file is JSON Lines; each line has ``question_id``, ``category`` and ``turns`` (a
non-empty list of user messages), as in Spec-Bench (Xia et al., 2024, "Unlocking Efficiency in
Large Language Model Inference: A Comprehensive Survey of Speculative Decoding"). The eight
MT-Bench sub-categories are reported together as one ``mt_bench`` group, like Spec-Bench does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..data import SPEC_BENCH_QUESTIONS, data_file, first_repeated, read_jsonl
from ..arguments import existing_file, user_path
from ..errors import InvalidParameter
from ..options import check_int

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
MT_BENCH = "mt_bench"
#: The 240 Spec-Bench dev questions shipped inside the package (``decodekit.data``).
DEFAULT_QUESTIONS = "the packaged Spec-Bench dev split"


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]

    @property
    def group(self) -> str:
        return category_group(self.category)


#: The reports' name for every category together (no question's category may take it).
OVERALL = "overall"


def category_group(category: str) -> str:
    """The reporting group of a category: MT-Bench sub-categories collapse into ``mt_bench``."""
    return MT_BENCH if category in MT_BENCH_CATEGORIES else category


def resolve_question_file(path: str | Path | None = None) -> Path:
    """The question file: the packaged Spec-Bench questions by default, else ``path`` (relative
    to the current directory)."""
    if path is None:
        return data_file(SPEC_BENCH_QUESTIONS)
    spec = existing_file(user_path(path), "question file", "not found; give an existing JSONL file with --questions")
    return spec.resolve()


def parse_question(raw: dict, where: str) -> Question:
    if not {"question_id", "category", "turns"} <= raw.keys():
        raise InvalidParameter(f"{where}: a question needs question_id, category and turns")
    turns = raw["turns"]
    # (a turn of whitespace alone is refused as decodekit generate refuses such a prompt)
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise InvalidParameter(f"{where}: turns must be a non-empty list of strings that are not blank")
    if not isinstance(raw["category"], str) or not raw["category"]:
        raise InvalidParameter(f"{where}: category must be a non-empty string")
    if category_group(raw["category"]) == OVERALL:  # the reports' name for all categories together
        raise InvalidParameter(f"{where}: the category name {OVERALL!r} is reserved for the reports' total")
    qid = raw["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)) or qid == "":
        raise InvalidParameter(f"{where}: question_id must be an integer or a non-empty string, got {qid!r:.40}")
    return Question(qid, raw["category"], tuple(turns))


def read_questions(path: Path) -> list[Question]:
    questions = [parse_question(raw, where) for where, raw in read_jsonl(path)]
    if not questions:
        raise InvalidParameter(f"{path}: no questions")
    # as reports print them: 1 and "1" are one id there (and in the notes, which name questions by it)
    twice = first_repeated(str(q.question_id) for q in questions)
    if twice is not None:
        raise InvalidParameter(f"{path}: question_id {twice} appears twice")
    return questions


def filter_categories(questions: Sequence[Question], categories: Iterable[str] | None) -> list[Question]:
    """Keep questions whose category or group is named; an unknown name is an error."""
    if not categories:
        return list(questions)
    wanted = set(categories)
    known = {q.category for q in questions} | {q.group for q in questions}
    unknown = sorted(wanted - known)
    if unknown:
        raise InvalidParameter(f"unknown categor{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; the file has: {', '.join(sorted(known))}")
    return [q for q in questions if q.category in wanted or q.group in wanted]


def balanced(questions: Sequence[Question], limit: int | None) -> list[Question]:
    """At most ``limit`` questions per group, taken round-robin over the group's sub-categories
    (so ``mt_bench`` with limit 8 gets one question of each MT-Bench category). File order otherwise."""
    if limit is None:
        return list(questions)
    check_int("--limit", limit)
    by_group: dict[str, dict[str, list[Question]]] = {}
    for q in questions:
        by_group.setdefault(q.group, {}).setdefault(q.category, []).append(q)
    chosen: list[Question] = []
    for subcategories in by_group.values():
        queues = [list(qs) for qs in subcategories.values()]
        picked = 0
        while picked < limit and any(queues):
            for queue in queues:
                if queue and picked < limit:
                    chosen.append(queue.pop(0))
                    picked += 1
    return chosen


def load_questions(
    path: str | Path | None = None, *, categories: Iterable[str] | None = None, limit: int | None = None
) -> list[Question]:
    """Read a question file, filter by category or group, keep ``limit`` questions per group."""
    return balanced(filter_categories(read_questions(resolve_question_file(path)), categories), limit)
