"""Backend.truncated(n): the model's first n layers as a backend of its own (self-speculative drafts)."""

from __future__ import annotations

import pytest
import torch

from decodekit.errors import InvalidParameter
from decodekit.models.hf import HFBackend
from decodekit.models.tiny import tiny_hf_model, tiny_llama


def test_a_truncated_model_is_the_full_model_with_its_last_layers_skipped():
    model = tiny_llama(seed=3, num_layers=4)
    ids = torch.tensor([[5, 17, 42, 8, 9]])
    skipped = model.append(ids, skip_layers=frozenset({2, 3})).logits
    draft = model.truncated(2)
    assert torch.equal(draft.append(ids).logits, skipped)
    assert draft.info.num_layers == 2 and draft.info.name == "tiny-llama[:2]"
    assert model.info.num_layers == 4 and len(model.weights.layers) == 4  # the model itself is unchanged


def test_a_truncated_model_shares_the_weights_but_not_the_cache_or_the_memory():
    model = tiny_llama(seed=3, num_layers=4)
    model.memory("learnt", lambda: "the parent's")
    model.prefill([1, 2, 3])
    draft = model.truncated(3)
    assert draft.weights.layers[0] is model.weights.layers[0] and draft.weights.embed is model.weights.embed
    assert draft.length == 0 and model.length == 3
    assert draft.memory("learnt", lambda: "its own") == "its own"
    assert draft.lock is not model.lock


@pytest.mark.parametrize("layers", [0, 5])
def test_truncating_to_a_layer_count_the_model_does_not_have_is_refused(layers):
    with pytest.raises(InvalidParameter, match="cannot truncate a model of 4 layers"):
        tiny_llama(num_layers=4).truncated(layers)


def test_a_backend_that_cannot_truncate_says_so():
    with pytest.raises(InvalidParameter, match="needs the native backend"):
        HFBackend(tiny_hf_model(num_layers=2)).truncated(1)
