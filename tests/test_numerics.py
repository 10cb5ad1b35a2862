"""The ``fast`` numerics (8-bit inputs, integer dot products on the GGUF blocks): close to
``exact``, and every promise ``exact`` makes about speculation holds relative to ``fast`` plain
decoding, token for token."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import required_options
from tests.marks import needs_fast_numerics
from decodekit.engine import Engine, available_methods
from decodekit.errors import InvalidParameter
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.llama_weights import LlamaConfig
from decodekit.models.native import NativeLlama
from decodekit.models.tiny import tiny_hf_config, tiny_llama, tiny_state_dict
from decodekit.speculative.controller import CostTable

pytestmark = needs_fast_numerics

PROMPTS = ("hello world hello world hello world hello", "abcabcabcabcabcabcabc", "Q: 12+12? A: 24. Q: 13+13? A:")
FLAT_COSTS = {1: 1.0, 64: 1.0}


def fast_model(seed: int, **kw) -> LoadedModel:
    return LoadedModel(tiny_llama(seed=seed, numerics="fast", **kw), CharTokenizer(96), "tiny")


@pytest.fixture(scope="module")
def engines() -> list[Engine]:
    return [Engine(fast_model(seed)) for seed in (0, 3)]


def test_a_tokens_row_is_the_same_alone_in_a_pass_and_in_prefill():
    """Each row is quantised and multiplied on its own: a token's logits in a one-token step are
    bit for bit its logits inside a multi-token pass (what makes verification lossless), and a
    prompt longer than the kernels' few-row limit also runs on the integer kernel. (Head size 16:
    the compiled attention kernel; with head size 8 attention goes through torch, whose results
    depend on the pass length, in either numerics.)"""
    backend = tiny_llama(seed=1, numerics="fast", hidden_size=64)
    tokens = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    together = backend.append(tokens).logits[0]
    backend.reset()
    alone = torch.cat([backend.append(tokens[:, i : i + 1]).logits[0] for i in range(7)])
    assert torch.equal(together, alone)
    backend.reset()
    long = backend.append(torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(1))).logits
    assert torch.isfinite(long).all()
    assert backend.weights.layers[0]["gate_up"].weight.is_meta  # no float32 copy of a packed projection


def test_fast_is_close_to_exact_and_not_the_same():
    exact = tiny_llama(seed=2, gguf_blocks=True)
    fast = tiny_llama(seed=2, numerics="fast")
    tokens = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    a, b = exact.append(tokens).logits, fast.append(tokens).logits
    error = ((a - b).norm() / a.norm()).item()
    assert 0 < error < 0.05
    assert exact.info.architecture != fast.info.architecture
    assert CostTable.key(exact) != CostTable.key(fast)  # each numerics gets its own cost curve


def speculative_methods() -> list[str]:
    return sorted(n for n, spec in available_methods().items() if spec.family == "speculative")


@pytest.mark.parametrize("method", speculative_methods())
def test_every_speculative_method_gives_fast_greedys_tokens_and_fast_samplings(engines, method):
    for engine in engines:
        options = required_options(method, engine.model.backend)
        for prompt in PROMPTS:
            want = engine.generate(prompt, max_new_tokens=40, chat=False).tokens
            for budget in ({"budget": 6}, {"cost_table": FLAT_COSTS}):
                got = engine.generate(prompt, method=method, max_new_tokens=40, chat=False, **budget, **options)
                assert got.tokens == want, (method, prompt, budget)
    sampled = dict(max_new_tokens=24, chat=False, temperature=0.8, seed=5)
    want = engines[0].generate(PROMPTS[0], method="sample", **sampled).tokens
    options = required_options(method, engines[0].model.backend)
    assert engines[0].generate(PROMPTS[0], method=method, budget=4, **sampled, **options).tokens == want


def test_fast_without_blocks_or_in_bfloat16_is_one_clear_error():
    """(NumericsUnavailable: what `decodekit serve` falls back to exact on, and only that.)"""
    from decodekit.errors import NumericsUnavailable

    config = tiny_hf_config()
    with pytest.raises(NumericsUnavailable, match="^the fast numerics is unavailable: it needs a GGUF model"):
        NativeLlama(LlamaConfig.from_hf(config), tiny_state_dict(config), numerics="fast")
    with pytest.raises(NumericsUnavailable, match="float32"):
        tiny_llama(numerics="fast", dtype=torch.bfloat16)
    with pytest.raises(InvalidParameter, match="^numerics must be one of exact, fast"):
        tiny_llama(numerics="int4")


def test_fast_on_the_hf_backend_or_an_unknown_numerics_is_one_clear_line(tmp_path):
    """Refused from the model's config, before any weights are read; on the command line, exit
    code 2 and one line."""
    import json

    from decodekit.models.loading import build_backend

    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    with pytest.raises(InvalidParameter, match="^the fast numerics runs on the native backend only"):
        build_backend(tmp_path, backend="hf", numerics="fast")
    for policy in ("int8", "int4", "int2", "sink:4,window:64"):  # HF's cache would hold everything in float
        with pytest.raises(InvalidParameter, match=f"^kv cache {policy} runs on the native backend only"):
            build_backend(tmp_path, backend="hf", kv_cache=policy)
    run = subprocess.run([sys.executable, "-m", "decodekit", "generate", "hi", "--numerics", "quick"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--numerics" in run.stderr


@pytest.mark.real_model
def test_real_model_fast_numerics_stays_near_exact_and_speculation_stays_lossless(real_model):
    from decodekit.models import load_model

    fast = load_model(numerics="fast")
    tokens = torch.tensor([real_model.prompt_ids("Explain how a bicycle works.")])
    a, b = real_model.backend.clone(), fast.backend.clone()
    la, lb = a.append(tokens).logits[0, -1], b.append(tokens).logits[0, -1]
    assert ((la - lb).norm() / la.norm()).item() < 0.05
    engine = Engine(fast)
    for prompt in ("List the first ten prime numbers, separated by commas.", "Repeat after me: one two three one two three"):
        want = engine.generate(prompt, max_new_tokens=48).tokens
        for method in ("pld", "recycling"):
            assert engine.generate(prompt, method=method, max_new_tokens=48, budget=6).tokens == want, method


def test_a_dtype_other_than_float32_or_bfloat16_is_one_clear_error():
    """The backends compute in float32 or bfloat16 only: a torch dtype outside those (float16) is
    refused like an unknown name, not passed on."""
    from decodekit.models.loading import parse_dtype

    assert parse_dtype(torch.bfloat16) is torch.bfloat16 and parse_dtype("float32") is torch.float32
    for dtype in (torch.float16, "float16", torch.float64):
        with pytest.raises(InvalidParameter, match="^dtype must be one of"):
            parse_dtype(dtype)


def test_the_native_backend_asked_for_an_architecture_it_lacks_is_one_clear_error(tmp_path):
    """--backend native on a model it does not compute is refused, never run on the HF backend instead."""
    import json

    from decodekit.models.loading import build_backend

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 96}))
    with pytest.raises(InvalidParameter, match="^the native backend supports llama, .*not 'gpt2'; use --backend hf"):
        build_backend(tmp_path, backend="native")


def test_a_fast_tiny_gemma3_is_close_to_exact_on_the_same_blocks_and_not_the_same():
    """tiny_gemma3(numerics="fast") runs the fast numerics on its blocks (not exact on them)."""
    from decodekit.models.tiny import tiny_gemma3

    exact, fast = tiny_gemma3(seed=2, gguf_blocks=True), tiny_gemma3(seed=2, numerics="fast")
    assert fast.numerics == "fast" and "numerics-fast" in fast.info.architecture
    tokens = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    a, b = exact.append(tokens).logits, fast.append(tokens).logits
    assert 0 < ((a - b).norm() / a.norm()).item() < 0.05
