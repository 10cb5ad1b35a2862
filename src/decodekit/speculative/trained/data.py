"""Training data from the target alone: self-distillation with Magpie prompts.

Magpie (Xu et al., 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs
with Nothing"): given only its chat template up to an empty user turn, an aligned model writes a
plausible user query. The target writes the queries (sampled, temperature 1, as Magpie), they are
de-duplicated and checked against the benchmark questions, and the target answers them (most
greedily, every ``sampled_every``-th one sampled), so the drafter learns the target's own outputs.
Every position's feature (the final norm's output) is recorded as the tokens are generated: the
training needs no second pass over the target.

Plain Magpie queries are short questions: the answers never quote a long prompt, as summaries,
translations and answers from retrieved passages do. With ``prompts="tasks"`` every other drafting
round starts the user turn with one of :data:`TASK_OPENINGS` (this project's own words, no
benchmark's), and the target writes the task's material itself (an article, a German text, passages,
a word problem) before answering it: Magpie's pre-query template, carried a few words further. A
material the target has not ended within ``material_tokens`` is kept, cut after its last full line.

The benchmark questions the project measures on (the shipped Spec-Bench and GSM8K files) never
reach the training data: a query whose normalised text, or any run of 8 of its words, matches one of
theirs is dropped, and :func:`check_excluded` asserts it on the finished set by hash.
"""

from __future__ import annotations

import functools
import hashlib
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...arguments import replace_file
from ...data import GSM8K_TEST, SPEC_BENCH_QUESTIONS, data_file, read_jsonl
from ...errors import InvalidParameter
from ...models.backend import Backend
from ...models.tokenizer import Tokenizer

QUERY_MARK = "\x00QUERY\x00"
SHINGLE = 8  # words
PROMPTS = ("magpie", "tasks")
TASK_OPENINGS = (
    "Summarize the following article in a few sentences.\n\n",
    "Translate this German text into English.\n\n",
    "Answer the question using the passages below.\n\n",
    "Solve this word problem step by step.\n\n",
)


@dataclass
class Sample:
    """One self-distilled conversation: template + query + the target's answer."""

    tokens: list[int]
    scored_from: int  # the query's first position: the shared template before it is not scored
    features: torch.Tensor  # [len(tokens), D] float16, the target's feature at every position
    query: str = ""


@dataclass
class Corpus:
    samples: list[Sample] = field(default_factory=list)
    queries_drafted: int = 0  # queries the target wrote, before de-duplication and checks
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)


# The benchmark questions, kept out ---------------------------------------------------------------------


def normalised(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def shingles(text: str) -> set[str]:
    """Hashes of every run of :data:`SHINGLE` consecutive words (the whole text if shorter)."""
    words = normalised(text).split()
    runs = [words] if len(words) < SHINGLE else [words[i : i + SHINGLE] for i in range(len(words) - SHINGLE + 1)]
    return {_digest(" ".join(run)) for run in runs if run}


def benchmark_questions() -> list[str]:
    """Every question text of the shipped benchmark files (Spec-Bench turns, GSM8K problems)."""
    texts: list[str] = []
    for _, row in read_jsonl(data_file(SPEC_BENCH_QUESTIONS)):
        texts.extend(str(turn) for turn in row.get("turns", []))
    for _, row in read_jsonl(data_file(GSM8K_TEST)):
        texts.append(str(row.get("question", "")))
    return [t for t in texts if t.strip()]


class Exclusion:
    """The benchmark questions as hashes: whole normalised texts and 8-word runs."""

    def __init__(self, questions: Iterable[str] | None = None):
        questions = benchmark_questions() if questions is None else list(questions)
        self.texts = {_digest(normalised(q)) for q in questions}
        self.runs: set[str] = set().union(*(shingles(q) for q in questions)) if questions else set()

    def overlaps(self, text: str) -> bool:
        return _digest(normalised(text)) in self.texts or not self.runs.isdisjoint(shingles(text))


#: Drafting rounds in a row that give no new query before self-distillation stops: once some came
#: (a model that only repeats itself), and before any came (a model that never ends a query).
BARREN_ROUNDS = 50
FIRST_BARREN_ROUNDS = 5


def leaked(corpus: Corpus, exclusion: Exclusion) -> list[str]:
    """The training queries that are, or share an 8-word run with, a benchmark question."""
    return [s.query for s in corpus.samples if exclusion.overlaps(s.query)]


def check_excluded(corpus: Corpus, exclusion: Exclusion) -> None:
    """Assert that no training query is, or shares an 8-word run with, a benchmark question."""
    leaked_queries = leaked(corpus, exclusion)
    if leaked_queries:
        raise AssertionError(f"{len(leaked_queries)} training queries overlap the benchmark questions, e.g. "
                             f"{leaked_queries[0]!r}")


# Generation on the target ----------------------------------------------------------------------------------


def pre_query(tokenizer: Tokenizer) -> list[int]:
    """The chat template up to an empty user turn's content (Magpie's pre-query template)."""
    text = tokenizer.chat_prompt([{"role": "user", "content": QUERY_MARK}])
    prefix = text.split(QUERY_MARK)[0] if text and QUERY_MARK in text else ""
    return list(tokenizer.prompt_prefix) + tokenizer.encode(prefix)


def chat_ids(tokenizer: Tokenizer, query: str) -> tuple[list[int], int]:
    """A query's prompt ids and where the query starts in them."""
    head = pre_query(tokenizer)
    text = tokenizer.chat_prompt([{"role": "user", "content": query}])
    ids = list(tokenizer.prompt_prefix) + tokenizer.encode(text if text is not None else query)
    start = len(head) if ids[: len(head)] == head else 0
    return ids, start


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0 or generator is None:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]


def check_trainable(backend: Backend, rows: int = 16) -> None:
    """What :func:`self_distil` needs, said before any data is made: passes that give features,
    and a cache that holds ``rows`` answers side by side."""
    if not backend.gives_features:
        raise InvalidParameter(f"training a drafter needs a backend that gives features (native), not {backend.info.architecture}")
    policy = getattr(backend, "kv_policy", None)
    if policy is not None and policy.one_sequence():
        raise InvalidParameter(f"training a drafter decodes {rows} answers side by side: it needs the full kv cache, "
                               f"not {policy.spec}")


def check_prompts(prompts: str) -> None:
    """One line for a recipe of queries that is not one of :data:`PROMPTS`."""
    if prompts not in PROMPTS:
        raise InvalidParameter(f"--prompts must be one of {', '.join(PROMPTS)}, got {prompts!r}")


def opening_of_round(prompts: str, round_: int) -> str:
    """The user turn's opening for drafting round ``round_``: none for plain Magpie; with ``tasks``,
    none in even rounds and the task openings in turn in odd ones."""
    if prompts == "magpie" or round_ % 2 == 0:
        return ""
    return TASK_OPENINGS[(round_ // 2) % len(TASK_OPENINGS)]


def _cut_after_last_line(text: str) -> str:
    head, newline, _ = text.rpartition("\n")
    return head.rstrip() if newline and head.strip() else ""


@torch.inference_mode()
def draft_queries(backend: Backend, tokenizer: Tokenizer, rows: int, max_tokens: int,
                  generator: torch.Generator, opening: str = "") -> list[str]:
    """``rows`` queries sampled side by side from the pre-query template (followed by ``opening``,
    which starts every query). Without an opening only the queries the target ended itself (an
    end-of-turn token within ``max_tokens``); with one, a material not ended is kept up to its
    last full line."""
    prefix = pre_query(tokenizer) or [next(iter(tokenizer.eos_token_ids))]
    if opening:
        prefix = prefix + tokenizer.encode(opening)
    logits = backend.prefill(prefix, batch_size=rows)
    out: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for _ in range(max_tokens):
        tokens = _choose(logits, 1.0, generator)
        for r, token in enumerate(tokens.tolist()):
            if not done[r]:
                if token in tokenizer.eos_token_ids:
                    done[r] = True
                else:
                    out[r].append(token)
        if all(done):
            break
        logits = backend.append(tokens[:, None]).logits[:, -1]
    if not opening:
        return [tokenizer.decode(ids).strip() for ids, ended in zip(out, done) if ended]
    materials = [tokenizer.decode(ids).strip() if ended else _cut_after_last_line(tokenizer.decode(ids))
                 for ids, ended in zip(out, done)]
    return [opening + material for material in materials if material]


@torch.inference_mode()
def answer(backend: Backend, tokenizer: Tokenizer, query: str, max_new_tokens: int,
           temperature: float = 0.0, generator: torch.Generator | None = None) -> Sample:
    """The target's answer to ``query``, with the target's feature at every position."""
    ids, start = chat_ids(tokenizer, query)
    backend.reset(1)
    out = backend.append(torch.tensor([ids]), last_only=True)
    tokens, features = list(ids), [out.features[0]]
    logits = out.logits[:, -1]
    for _ in range(max_new_tokens):
        token = int(_choose(logits, temperature, generator)[0])
        out = backend.append(torch.tensor([[token]]))
        tokens.append(token)
        features.append(out.features[0])
        logits = out.logits[:, -1]
        if token in tokenizer.eos_token_ids:
            break
    return Sample(tokens, start, torch.cat(features).half(), query)


def answer_all(backend: Backend, tokenizer: Tokenizer, jobs: list[tuple[str, float, int]], max_new_tokens: int,
               concurrency: int) -> list[Sample]:
    """Answers to ``jobs`` (query, temperature, seed), ``concurrency`` at a time, each on its own clone
    of the model, their passes run as one by a :class:`~decodekit.models.batching.PassBatcher` (rows
    are computed independently: every answer is the one it would be alone, features included)."""
    from ...models.batching import PassBatcher

    batcher = PassBatcher(own_thread=False)  # its members and their passes on this thread
    results: list[Sample | None] = [None] * len(jobs)
    queue = list(range(len(jobs)))[::-1]
    failed: list[bool] = []  # one member's error stops the others at their next answer

    def work(clone: Backend) -> None:
        clone.batcher = batcher
        while queue and not failed:
            i = queue.pop()
            query, temperature, seed = jobs[i]
            generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
            try:
                results[i] = answer(clone, tokenizer, query, max_new_tokens, temperature, generator)
            except BaseException:
                failed.append(True)
                raise

    batcher.run_here([functools.partial(work, backend.clone()) for _ in range(max(1, min(concurrency, len(jobs))))])
    return [r for r in results if r is not None]


def self_distil(backend: Backend, tokenizer: Tokenizer, tokens: int, *, seed: int = 0, max_new_tokens: int = 160,
                query_tokens: int = 64, material_tokens: int = 256, prompts: str = "magpie", rows: int = 16,
                sampled_every: int = 4, wave: int = 64, exclusion: Exclusion | None = None,
                progress: Callable[[int], None] | None = None) -> Corpus:
    """Queries and answers until the samples hold ``tokens`` tokens (see the module docstring).
    Queries are drafted ``rows`` at a time and answered ``wave`` at a time, ``rows`` concurrently;
    every ``sampled_every``-th answer is sampled (temperature 1, its own seed), the others greedy."""
    check_prompts(prompts)
    check_trainable(backend, rows)
    exclusion = exclusion or Exclusion()
    generator = torch.Generator().manual_seed(seed)
    corpus, seen = Corpus(), set()
    t0 = time.perf_counter()
    barren = rounds = 0  # barren: drafting rounds in a row that gave nothing new

    def drafting() -> bool:  # a model that only repeats itself, or never drafted a query at all: stop, do not spin
        return barren < (BARREN_ROUNDS if seen else FIRST_BARREN_ROUNDS)

    while corpus.tokens < tokens and drafting():
        jobs: list[tuple[str, float, int]] = []
        while len(jobs) < wave and drafting():
            opening = opening_of_round(prompts, rounds)
            rounds += 1
            drafted = draft_queries(backend, tokenizer, rows, material_tokens if opening else query_tokens, generator,
                                    opening)
            corpus.queries_drafted += rows
            fresh = 0
            for query in drafted:
                key = normalised(query)
                if len(key.split()) < 3 or key in seen or exclusion.overlaps(query):
                    continue
                seen.add(key)
                fresh += 1
                n = len(corpus.samples) + len(jobs)
                sampled = n % sampled_every == sampled_every - 1
                jobs.append((query, 1.0 if sampled else 0.0, seed * 1_000_003 + n))
            barren = 0 if fresh else barren + 1
        for sample in answer_all(backend, tokenizer, jobs, max_new_tokens, rows):
            if corpus.tokens >= tokens:
                break
            corpus.samples.append(sample)
            if progress:
                progress(len(sample.tokens))
    corpus.seconds = time.perf_counter() - t0
    if not corpus.samples:  # said now, and no empty corpus is cached for the next run to fail on at once
        template = tokenizer.chat_prompt([{"role": "user", "content": QUERY_MARK}]) is not None
        raise InvalidParameter(f"{backend.info.name} drafted no usable query in {rounds} drafting rounds"
                               + ("" if template else ": it has no chat template, whose empty user turn Magpie drafts "
                                  "queries from" + ("; try --prompts tasks" if prompts == "magpie" else "")))
    check_excluded(corpus, exclusion)
    return corpus


# The corpus on disk (made once per target, shared by the drafter kinds) ------------------------------


def save_corpus(corpus: Corpus, path) -> None:
    saved = {"samples": [{"tokens": s.tokens, "scored_from": s.scored_from, "features": s.features, "query": s.query}
                         for s in corpus.samples],
             "queries_drafted": corpus.queries_drafted, "seconds": corpus.seconds}
    replace_file(Path(path), lambda temporary: torch.save(saved, temporary))


def load_corpus(path) -> Corpus | None:
    """The corpus saved at ``path``, or None when there is none or it cannot be read (made again)."""
    try:
        saved = torch.load(path, weights_only=True)
        samples = [Sample(list(s["tokens"]), int(s["scored_from"]), s["features"], str(s["query"]))
                   for s in saved["samples"]]
        return Corpus(samples, int(saved["queries_drafted"]), float(saved["seconds"]))
    except FileNotFoundError:
        return None
    except Exception:  # a damaged file: the data is made again, never trusted
        return None
