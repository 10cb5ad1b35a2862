"""The penalties count what their definitions count, on every path that builds histories: the
frequency and presence penalties the generated ids only (OpenAI's and vLLM's definition), the
repetition penalty the prompt too (CTRL's and Hugging Face's). Each decoding path is checked
against a hand-written greedy loop: plain decoding, speculative verification (each tree node's
history is the context plus its own path), search's batched decoding and beam search."""

from __future__ import annotations

import pytest
import torch

from decodekit.engine import Engine
from decodekit.engine.core import Request
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.backend import Backend, ModelInfo, StepOutput
from decodekit.models.tiny import tiny_llama
from decodekit.samplers import Sampler
from decodekit.search import decode_batch

PENALTIES = {"frequency_penalty": 0.3, "presence_penalty": 0.3, "repetition_penalty": 1.2}
N = 24


class CycleBackend(Backend):
    """Logits after token t are ``table[t]`` (batched, with tree verification): a test double."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.info = ModelInfo("cycle", table.shape[0], 1, 1, 4096, torch.float32, "cycle")
        self.reset(1)

    @property
    def length(self) -> int:
        return len(self.rows[0])

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def reset(self, batch_size: int = 1) -> None:
        self.rows, self.tree = [[] for _ in range(batch_size)], []

    def append(self, tokens, *, hidden_layers=(), skip_layers=frozenset(), last_only=False) -> StepOutput:
        for row, new in zip(self.rows, tokens.tolist()):
            row.extend(new)
        logits = self.table[tokens]
        return StepOutput(logits[:, -1:] if last_only else logits)

    def truncate(self, length: int) -> None:
        self.rows = [r[:length] for r in self.rows]

    def reorder(self, rows) -> None:
        self.rows = [list(self.rows[i]) for i in rows.tolist()]

    def verify_tree(self, tokens, parents) -> StepOutput:
        self.tree = tokens.tolist()
        return StepOutput(self.table[tokens.view(1, -1)])

    def commit_path(self, nodes) -> None:
        self.rows[0].extend(self.tree[i] for i in nodes)


def cycle_model() -> LoadedModel:
    """1 -> 2 -> 3 -> 1 with logit 3; from each, an exit (4, 5, 6) with logit 1.1 that leads back.
    After the repetition penalty a cycle token keeps 2.5, a margin of 1.4 over its exit: with the
    penalties above the cycle goes on while a token was generated at most 3 times (0.3 * 3 + 0.3
    < 1.4), so context drafts are accepted, and breaks where a draft's own path makes it 4; if the
    prompt's 11 copies counted, it would break at once."""
    table = torch.zeros(16, 16)  # (search records the top 10 log-probs, so at least 10 tokens)
    table[:, 0] = float("-inf")  # no EOS
    for a, b, exit_ in ((1, 2, 4), (2, 3, 5), (3, 1, 6)):
        table[a, b], table[a, exit_], table[exit_, b] = 3.0, 1.1, 3.0
    return LoadedModel(CycleBackend(table), CharTokenizer(16), "cycle")


def tiny_model() -> LoadedModel:
    return LoadedModel(tiny_llama(seed=1, vocab_size=96), CharTokenizer(96), "tiny")


MODELS = {"cycle": (cycle_model, [1, 2, 3] * 11), "tiny": (tiny_model, CharTokenizer(96).encode("[zm" * 6))}


def reference(model: LoadedModel, prompt: list[int], n: int, *, count_prompt: bool = False) -> list[int]:
    """Greedy decoding with PENALTIES applied by hand; ``count_prompt`` is the old (wrong) rule."""
    tokens, vocab = list(prompt), model.backend.info.vocab_size
    for _ in range(n):
        x = model.backend.prefill(tokens)[0].float()
        every = torch.bincount(torch.tensor(tokens), minlength=vocab)
        counted = every if count_prompt else torch.bincount(torch.tensor(tokens[len(prompt):], dtype=torch.long), minlength=vocab)
        r = PENALTIES["repetition_penalty"]
        x = torch.where(every > 0, torch.where(x > 0, x / r, x * r), x)
        x = x - PENALTIES["frequency_penalty"] * counted - PENALTIES["presence_penalty"] * (counted > 0)
        token = int(x.argmax())
        if token in model.tokenizer.eos_token_ids:
            break
        tokens.append(token)
    return tokens[len(prompt):]


@pytest.fixture(scope="module", params=list(MODELS))
def case(request) -> tuple[LoadedModel, list[int], list[int]]:
    make, prompt = MODELS[request.param]
    model = make()
    want = reference(model, prompt, N)
    assert want != reference(model, prompt, N, count_prompt=True)  # the prompt's counts matter here
    return model, prompt, want


def test_plain_decoding_counts_generated_ids_for_frequency_and_presence(case):
    model, prompt, want = case
    assert Engine(model).generate(prompt, max_new_tokens=N, chat=False, **PENALTIES).tokens == want


@pytest.mark.parametrize("method", ["pld", "recycling"])
def test_speculative_verification_counts_the_same(case, method):
    model, prompt, want = case
    g = Engine(model).generate(prompt, method=method, budget=4, max_new_tokens=N, chat=False, **PENALTIES)
    assert g.tokens == want
    if model.name == "cycle" and method == "pld":  # drafts of the cycle were accepted, node paths counted
        assert g.stats.extra["mean_accepted"] > 1.5


def test_search_paths_count_the_same(case):
    model, prompt, want = case
    request = Request(list(prompt), Sampler.from_params(temperature=0, **PENALTIES), N)
    assert decode_batch(model, request, 2)[1].tokens == want
    assert Engine(model).generate(prompt, method="beam", n=1, max_new_tokens=N, chat=False, **PENALTIES).tokens == want


@pytest.mark.parametrize("params", [{"repetition_penalty": 1.2e-38}, {"frequency_penalty": -3e38}])
def test_a_penalty_past_float32s_range_saturates_and_a_masked_token_stays_masked(params):
    """In-range penalties so strong that a seen token's logit would overflow: it saturates at the
    largest float32, so the probabilities stay a distribution over the seen tokens (never NaN), and
    a token masked before the penalty (-inf) is not brought back."""
    sampler = Sampler.from_params(temperature=1.0, **params)
    logits = torch.tensor([[5.0, 6.0, -1.0, float("-inf"), 2.0]])
    # tokens 1 and 3 twice: the frequency penalty doubles for them (-inf - 2 * -3e38 would be NaN)
    history = [torch.tensor([0, 1, 1, 3, 3])]
    processed = sampler.process(logits, history)
    assert torch.isfinite(processed[0, [0, 1, 2, 4]]).all() and processed[0, 3] == float("-inf")
    assert processed[0, 1] == torch.finfo(torch.float32).max  # 6 / 1.2e-38 and 6 + 2 * 3e38 overflow
    probs = sampler.probs(logits, history)[0]
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-6 and float(probs[[0, 1]].sum()) == 1.0
    if "repetition_penalty" in params:  # both seen tokens saturate: a tie
        assert probs.tolist() == [0.5, 0.5, 0.0, 0.0, 0.0]
