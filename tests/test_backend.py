"""The backend contract: logits match transformers, rollback is exact, tree verification
gives every node the logits of decoding its path sequentially."""

from __future__ import annotations

import random

import pytest
import torch

from decodekit.models.backend import tree_ancestor_mask, tree_depths
from decodekit.models.hf import HFBackend
from decodekit.models.tiny import tiny_hf_model, tiny_llama

ATOL = 1e-4


@pytest.fixture(params=["native", "hf"])
def backend(request):
    """The native backend and transformers' on the same tiny weights, each built when a test runs
    (not at collection: a transformers model takes a while to build)."""
    return tiny_llama(seed=0) if request.param == "native" else HFBackend(tiny_hf_model(seed=0))


def tokens(n: int, vocab: int = 96, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def random_tree(n: int, rng: random.Random) -> list[int]:
    return [-1 if i == 0 else rng.randrange(-1, i) for i in range(n)]


def path_to(node: int, parents: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_native_logits_match_transformers():
    native = tiny_llama(seed=3)
    hf = tiny_hf_model(seed=3)
    ids = tokens(40)
    with torch.no_grad():
        ref = hf(ids).logits
    got = torch.cat([native.append(ids[:, :25]).logits, native.append(ids[:, 25:]).logits], dim=1)
    assert torch.allclose(got, ref, atol=ATOL)


def test_tiny_weights_scale_multiplies_every_random_weight():
    """tiny_state_dict's ``scale`` multiplies the spread of every random weight (the norm weights
    stay ones): the documented knob for sharper next-token distributions."""
    from decodekit.models.tiny import tiny_hf_config, tiny_state_dict

    config = tiny_hf_config()
    plain, sharp = tiny_state_dict(config, seed=7), tiny_state_dict(config, seed=7, scale=2.0)
    assert plain.keys() == sharp.keys()
    for name, weight in plain.items():
        assert torch.equal(sharp[name], weight if name.endswith("norm.weight") else 2 * weight), name


def test_tiny_model_and_the_transformers_model_take_the_scale_too():
    """tiny_model and tiny_hf_model are tiny_llama's model (same seed, same scale) behind another
    interface: a scale given to them reaches their weights."""
    from decodekit.models.tiny import tiny_model

    ids = tokens(12)
    want = tiny_llama(seed=3, scale=2.0).append(ids).logits
    assert not torch.equal(want, tiny_llama(seed=3).append(ids).logits)
    assert torch.equal(tiny_model(seed=3, scale=2.0).backend.append(ids).logits, want)
    with torch.no_grad():
        ref = tiny_hf_model(seed=3, scale=2.0)(ids).logits
    assert torch.allclose(want, ref, atol=ATOL)


@pytest.mark.parametrize("wrong", [7, 1])
def test_truncate_then_append_equals_fresh_run(backend, wrong):
    """A wrong continuation rolled back (one token, as speculative decoding often rejects, or several):
    the cache drops its entries, and the rest reads as in a fresh run."""
    ids = tokens(30)
    backend.reset()
    fresh = backend.append(ids).logits
    backend.reset()
    backend.append(ids[:, :20])
    backend.append(tokens(wrong, seed=9))
    backend.truncate(20)
    assert backend.length == 20
    redo = backend.append(ids[:, 20:]).logits
    assert torch.allclose(redo, fresh[:, 20:], atol=ATOL)


def test_every_tree_node_matches_sequential_decoding(backend):
    rng = random.Random(0)
    context = tokens(12)
    for trial in range(4):
        parents = random_tree(9, rng)
        node_tokens = tokens(9, seed=100 + trial)[0]
        backend.reset()
        backend.append(context)
        tree_logits = backend.verify_tree(node_tokens, parents).logits[0]
        for node in range(len(parents)):
            path = path_to(node, parents)
            backend.reset()
            seq = backend.append(torch.cat([context, node_tokens[path][None]], dim=1)).logits[0, -1]
            assert torch.allclose(tree_logits[node], seq, atol=ATOL), (parents, node)


def test_commit_path_keeps_only_the_accepted_branch(backend):
    context = tokens(10)
    parents = [-1, 0, 0, 1, 2, 4]
    node_tokens = tokens(6, seed=5)[0]
    backend.reset()
    backend.append(context)
    backend.verify_tree(node_tokens, parents)
    backend.commit_path([0, 2, 4, 5])
    assert backend.length == 14
    after = backend.append(tokens(3, seed=6)).logits
    backend.reset()
    ref = backend.append(torch.cat([context, node_tokens[[0, 2, 4, 5]][None], tokens(3, seed=6)], dim=1)).logits
    assert torch.allclose(after, ref[:, -3:], atol=ATOL)


def test_fork_and_reorder_rows(backend):
    ids = tokens(8)
    logits = backend.prefill(ids[0].tolist(), batch_size=3)
    assert logits.shape[0] == 3 and backend.batch_size == 3
    step = backend.append(torch.tensor([[1], [2], [3]])).logits[:, -1]
    backend.reorder(torch.tensor([2, 2, 0]))
    nxt = backend.append(torch.tensor([[4], [4], [4]])).logits[:, -1]
    assert torch.allclose(nxt[0], nxt[1], atol=ATOL)
    for row, first in ((0, 3), (2, 1)):
        backend.reset()
        ref = backend.append(torch.cat([ids, torch.tensor([[first, 4]])], dim=1)).logits[0, -1]
        assert torch.allclose(nxt[row], ref, atol=ATOL)
    assert not torch.allclose(step[0], step[1])


def test_a_batch_of_more_rows_than_the_kernels_take_gets_each_rows_own_logits():
    """A search steps B rows at once, and B may pass the row kernels' 64: the output head then went
    to a GEMM over all of them, which sums otherwise (logits 2e-6 off each row's alone)."""
    from decodekit.models.kernels import MAX_ROWS

    together, alone = tiny_llama(seed=2, hidden_size=64), tiny_llama(seed=2, hidden_size=64)
    prompt, rows = tokens(20, seed=3), MAX_ROWS + 6
    together.append(prompt)
    together.reorder(torch.zeros(rows, dtype=torch.long))
    nxt = torch.randint(0, 96, (rows,), generator=torch.Generator().manual_seed(0))
    batch = together.step(nxt)
    for r in (0, MAX_ROWS - 1, MAX_ROWS, rows - 1):  # rows of the first call, and of the second
        alone.reset()
        alone.append(prompt)
        assert torch.equal(batch[r], alone.step(nxt[r : r + 1])[0])


def test_cache_grows_past_its_initial_capacity():
    small = tiny_llama(seed=2)
    small._initial_capacity = 8
    small.reset()
    ids = tokens(50)
    got = torch.cat([small.append(ids[:, i : i + 5]).logits for i in range(0, 50, 5)], dim=1)
    ref = tiny_llama(seed=2).append(ids).logits
    assert torch.allclose(got, ref, atol=ATOL)


def test_skipping_layers_changes_logits_and_empty_skip_does_not():
    model = tiny_llama(seed=4, num_layers=4)
    ids = tokens(6)
    full = model.append(ids).logits
    model.reset()
    assert torch.equal(model.append(ids, skip_layers=frozenset()).logits, full)
    model.reset()
    assert not torch.allclose(model.append(ids, skip_layers=frozenset({1, 2})).logits, full)


def test_hidden_states_are_returned_for_requested_layers():
    model = tiny_llama(seed=4, num_layers=3)
    out = model.append(tokens(5), hidden_layers=(0, 2, 3))
    assert set(out.hidden) == {0, 2, 3}
    assert out.hidden[3].shape == (1, 5, 32)


def test_hidden_states_and_features_are_transformers_values():
    """Values, not shapes: the residual stream after each layer and the final norm's output (the
    features trained drafters read) against transformers' hidden states on the same weights."""
    from decodekit.models.tiny import tiny_hf_model

    ids = torch.tensor([[5, 17, 33, 2, 9, 40, 11, 60]])
    native = tiny_llama(seed=4, num_layers=3).append(ids, hidden_layers=(0, 1, 2, 3))
    with torch.no_grad():
        reference = tiny_hf_model(seed=4, num_layers=3)(ids, output_hidden_states=True).hidden_states
    for layer in range(3):  # transformers' last entry is after the final norm
        torch.testing.assert_close(native.hidden[layer], reference[layer], rtol=0, atol=1e-4)
    torch.testing.assert_close(native.features, reference[3], rtol=0, atol=1e-4)
    assert not torch.allclose(native.hidden[3], reference[3], atol=1e-2)  # the stream itself is not normed


def test_bfloat16_is_close_to_float32():
    ids = tokens(20)
    f32 = tiny_llama(seed=1).append(ids).logits
    b16 = tiny_llama(seed=1, dtype=torch.bfloat16).append(ids).logits
    assert b16.dtype == torch.float32  # logits are always returned in float32
    assert (f32.argmax(-1) == b16.argmax(-1)).float().mean() > 0.8


def test_tree_helpers():
    parents = [-1, 0, 0, 1, -1]
    assert tree_depths(parents) == [0, 1, 1, 2, 0]
    mask = tree_ancestor_mask(parents)
    assert mask[3].tolist() == [True, True, False, True, False]
    assert mask[4].tolist() == [False, False, False, False, True]
    with pytest.raises(ValueError):
        tree_depths([1, -1])


def test_context_overflow_is_reported():
    model = tiny_llama(seed=0, max_position=16)
    with pytest.raises(ValueError, match="context"):
        model.append(tokens(20))


def test_a_sequence_that_fills_the_context_exactly_fits():
    """The context holds max_position tokens: a cache growing to exactly that many is no overflow."""
    model = tiny_llama(seed=0, max_position=16)
    model._initial_capacity = 8
    model.reset()
    got = model.append(tokens(16)).logits
    ref = tiny_llama(seed=0, max_position=16).append(tokens(16)).logits
    assert model.length == 16 and torch.allclose(got, ref, atol=ATOL)


def test_a_growing_cache_never_allocates_past_the_context():
    """Growth leaves room past a long prompt, but never more positions than the model can attend
    to: the memory check and the allocation are for at most max_position entries."""
    model = tiny_llama(seed=0, max_position=16)
    model._initial_capacity = 8
    model.reset()
    model.append(tokens(10))
    assert model._k.shape[3] == 16 and model._v.shape[3] == 16
    small = tiny_llama(seed=0, max_position=16)  # a first capacity (512) past the context: the context's
    assert small._k.shape[3] == 16 and small._v.shape[3] == 16


def test_reset_forgets_the_last_sequences_peak():
    """A cache's peak is that of the sequence it holds: after reset, a shorter sequence's peak
    is its own size, not the previous sequence's."""
    model = tiny_llama(seed=0)
    model.append(tokens(10))
    model.reset()
    model.append(tokens(3))
    assert model.cache_bytes(peak=True) == model.cache_bytes() > 0


def test_clone_shares_weights_but_not_the_cache(backend):
    ids = tokens(10)
    backend.reset()
    backend.append(ids)
    twin = backend.clone()
    assert twin.length == 0 and backend.length == 10
    fresh = twin.append(ids[:, :4]).logits
    backend.reset()
    assert torch.allclose(backend.append(ids[:, :4]).logits, fresh, atol=ATOL)


# head size 8 runs through torch; 16 has every kernel (whose one-call path takes no bias)
HEAD_SIZES = pytest.mark.parametrize("hidden_size", [32, 64], ids=["torch", "kernels"])


@HEAD_SIZES
def test_a_llama_with_attention_bias_adds_the_output_projections_bias_too(hidden_size):
    """transformers' Llama puts attention_bias on q, k, v and o (Qwen2 on q, k, v only)."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    from decodekit.models.llama_weights import LlamaConfig
    from decodekit.models.native import NativeLlama
    from decodekit.models.tiny import tiny_hf_config

    config = tiny_hf_config(hidden_size=hidden_size) | {"attention_bias": True}
    torch.manual_seed(0)
    hf = LlamaForCausalLM(HFLlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})).eval()
    state = {name: t + 0.1 * torch.randn_like(t) if name.endswith("bias") else t for name, t in hf.state_dict().items()}
    hf.load_state_dict(state)
    native = NativeLlama(LlamaConfig.from_hf(config), state)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.allclose(native.append(ids).logits, hf(ids).logits, atol=1e-4)


def native_and_transformers_logits(config: dict, state: dict, hf_class=None, hf_config_class=None):
    """Logits of 24 tokens from the native backend and from transformers, on one config.json and weights."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    from decodekit.models.llama_weights import LlamaConfig
    from decodekit.models.native import NativeLlama

    hf_config = (hf_config_class or HFLlamaConfig)(**{k: v for k, v in config.items() if k != "model_type"})
    hf = (hf_class or LlamaForCausalLM)(hf_config).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing)  # (a tied head is the table)
    ids = tokens(24)
    with torch.no_grad():
        return NativeLlama(LlamaConfig.from_hf(config), state).append(ids).logits, hf(ids).logits


@pytest.mark.parametrize("change", [
    {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},  # Llama 3's base, in rope_parameters
    {"head_dim": 16},  # wider than hidden_size / heads, as Gemma's and Qwen3's
    {"num_key_value_heads": 1},  # one key/value head for every query head (MQA)
    {"num_key_value_heads": 4},  # no sharing (MHA)
    {"rms_norm_eps": 0.5},
    {"rope_scaling": None, "mlp_bias": False, "attention_bias": False},  # as transformers writes "none": null, false
], ids=["rope-theta", "head-dim", "mqa", "mha", "eps", "nothing-named"])
def test_native_reads_config_json_as_transformers_does(change):
    """Each config.json field the native backend reads means what it means to transformers' Llama."""
    from decodekit.models.tiny import tiny_hf_config, tiny_state_dict

    config = tiny_hf_config() | change
    native, hf = native_and_transformers_logits(config, tiny_state_dict(config, seed=5))
    assert torch.allclose(native, hf, atol=ATOL)


def test_a_tied_head_is_the_embedding_table_even_where_the_weights_hold_another():
    """tie_word_embeddings: the output head is the embedding table (transformers ties them), whatever
    lm_head.weight a checkpoint also carries."""
    from decodekit.models.tiny import tiny_hf_config, tiny_state_dict

    config = tiny_hf_config() | {"tie_word_embeddings": True}
    state = tiny_state_dict(config, seed=6)  # its lm_head.weight is not the table
    native, hf = native_and_transformers_logits(config, {k: v for k, v in state.items() if k != "lm_head.weight"})
    assert torch.allclose(native, hf, atol=ATOL)
    from decodekit.models.llama_weights import LlamaConfig
    from decodekit.models.native import NativeLlama

    with_head = NativeLlama(LlamaConfig.from_hf(config), state).append(tokens(24)).logits
    assert torch.allclose(with_head, hf, atol=ATOL)


@HEAD_SIZES
def test_a_qwen2_config_json_gives_q_k_and_v_their_biases(hidden_size):
    """Qwen2's q, k and v projections carry biases although its config.json names no attention_bias."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from decodekit.models.tiny import tiny_hf_config

    config = tiny_hf_config(hidden_size=hidden_size) | {"model_type": "qwen2"}
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in config.items() if k != "model_type"}))
    state = {name: t + 0.2 * torch.randn_like(t) if name.endswith("bias") else t for name, t in hf.state_dict().items()}
    assert any(name.endswith("q_proj.bias") for name in state)
    native, want = native_and_transformers_logits(config, state, Qwen2ForCausalLM, Qwen2Config)
    assert torch.allclose(native, want, atol=ATOL)


def test_config_json_defaults_are_transformers_llama_defaults():
    """Where config.json leaves a field out, the native backend takes transformers' default for it."""
    from transformers import LlamaConfig as HFLlamaConfig

    from decodekit.models.llama_weights import LlamaConfig
    from decodekit.models.tiny import tiny_hf_config

    left_out = ("rms_norm_eps", "tie_word_embeddings", "num_key_value_heads", "head_dim", "rope_parameters")
    config = {k: v for k, v in tiny_hf_config().items() if k not in left_out}
    ours, theirs = LlamaConfig.from_hf(config), HFLlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert ours.rms_norm_eps == theirs.rms_norm_eps and ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.num_kv_heads == theirs.num_key_value_heads and ours.head_dim == theirs.head_dim
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]


@pytest.mark.parametrize("model_type, extra", [("mistral", {}), ("qwen2", {"use_sliding_window": True})])
def test_a_window_as_long_as_the_context_runs_natively(model_type, extra):
    """A sliding window that covers the whole context changes nothing (Mistral v0.2 and Qwen2 name one):
    only a shorter window is refused."""
    from decodekit.models.llama_weights import native_unsupported
    from decodekit.models.tiny import tiny_hf_config

    config = tiny_hf_config(max_position=128) | {"model_type": model_type, "sliding_window": 128} | extra
    assert native_unsupported(config) is None
    assert "a window of 127" in native_unsupported(config | {"sliding_window": 127})


def test_the_hf_backend_gives_mistrals_window_to_every_layer():
    """Mistral's layers attend to the last sliding_window positions without a list of layer kinds:
    the mask the HF backend passes carries the window (a plain causal mask overrode it)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                             sliding_window=4, max_position_embeddings=128)).eval()
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    backend = HFBackend(model)
    assert backend.window == 4
    assert torch.allclose(backend.append(ids[:, :12]).logits, want[:, :12], atol=1e-5)
    steps = [backend.append(ids[:, t : t + 1]).logits for t in range(12, 20)]
    assert torch.allclose(torch.cat(steps, dim=1), want[:, 12:], atol=1e-5)


def test_a_memory_family_keeps_its_most_recently_used_values_only():
    """Values keyed by a request's options (a draft cache's spelling) are bounded per family, the
    least recently used dropped first; other keys are kept whatever happens to a family."""
    backend = tiny_llama(seed=0)
    made = []
    value = lambda key, keep=2: backend.memory(("family", key), lambda: made.append(key) or key, keep=keep)
    backend.memory("corpus", list)
    for key in ("a", "b", "a", "c"):  # "a" used again before "c" comes: "b" is the one dropped
        value(key)
    assert made == ["a", "b", "c"] and value("a") == "a" and made == ["a", "b", "c"]
    value("b")
    assert made == ["a", "b", "c", "b"]  # made again: it had been dropped
    assert {k for k in backend._memory if isinstance(k, tuple)} == {("family", "a"), ("family", "b")}
    assert "corpus" in backend._memory


def test_requests_varying_a_draft_cache_or_a_draft_models_spelling_keep_few_clones(tmp_path):
    """kvdraft kept a clone of the model and its cache for every draft_cache a request named, and a
    draft model a copy for every spelling of its folder."""
    from decodekit.engine import Engine
    from decodekit.models import CharTokenizer, LoadedModel
    from decodekit.speculative.drafters.draft_model import KEPT_DRAFTS, _one_spelling

    model = LoadedModel(tiny_llama(seed=0, hidden_size=64), CharTokenizer(96), "tiny")
    engine = Engine(model)
    for budget in range(16, 24):
        engine.generate("abc abc abc abc", method="kvdraft", draft_cache=f"h2o:budget={budget},window=4",
                        max_new_tokens=4, chat=False)
    kept = [k for k in model.backend._memory if isinstance(k, tuple) and k[0] == "kvdraft"]
    assert kept == [("kvdraft", "h2o:budget=22,window=4"), ("kvdraft", "h2o:budget=23,window=4")] and KEPT_DRAFTS == 2
    (tmp_path / "m").mkdir()
    assert _one_spelling(str(tmp_path / "m" / ".." / "m")) == _one_spelling(str(tmp_path / "m")) == str(tmp_path / "m")
    assert _one_spelling("smollm2-135m") == "smollm2-135m"


def test_a_tree_node_cannot_be_its_own_parent():
    """Nodes come in topological order: a parent's index is below its child's, never equal to it."""
    for parents in ([0], [-1, 1]):
        with pytest.raises(ValueError, match="topologically ordered"):
            tree_depths(parents)


def test_a_second_commit_path_without_a_new_verification_is_refused():
    """commit_path keeps nodes of the tree the last verify_tree wrote: once they are committed no
    tree is pending, and a second commit is refused rather than moving committed entries."""
    backend = tiny_llama(seed=0)
    backend.append(tokens(5))
    backend.verify_tree(tokens(3, seed=2)[0], [-1, 0, 1])
    backend.commit_path([0, 1])
    assert backend.length == 7
    with pytest.raises(RuntimeError, match="verify_tree"):
        backend.commit_path([0])
    assert backend.length == 7


def test_a_cache_of_several_rows_grows_past_its_initial_capacity_keeping_every_row():
    """Growing the cache copies every row of a search's cache: each row then decodes as its
    sequence does alone."""
    small = tiny_llama(seed=2)
    small._initial_capacity = 8
    small.reset()
    prompt = tokens(6)
    small.prefill(prompt[0].tolist(), batch_size=2)
    nxt = torch.tensor([[3], [4]])
    for _ in range(5):  # 16 tokens: past the 8 slots
        out = small.append(torch.cat([nxt, nxt], dim=1))
    for row in range(2):
        alone = tiny_llama(seed=2)
        alone.append(prompt)
        for _ in range(5):
            want = alone.append(torch.cat([nxt[row : row + 1]] * 2, dim=1))
        assert torch.allclose(out.logits[row], want.logits[0], atol=ATOL)


def test_tree_verification_over_several_rows_is_refused():
    """A token tree is verified for one sequence (batch of one row): with forked rows it is refused."""
    backend = tiny_llama(seed=0)
    backend.prefill(tokens(5)[0].tolist(), batch_size=2)
    with pytest.raises(ValueError, match="one row"):
        backend.verify_tree(tokens(3, seed=2)[0], [-1, 0, 1])


def test_a_clone_starts_with_an_empty_memory(backend):
    """What a model learnt across requests (memory()) is its own: a clone starts empty and what
    either learns afterwards stays its own."""
    backend.memory("corpus", list).append("parent's")
    twin = backend.clone()
    assert twin.memory("corpus", list) == []
    twin.memory("corpus", list).append("twin's")
    assert backend.memory("corpus", list) == ["parent's"] and twin.lock is not backend.lock


def test_first_logits_with_nan_or_plus_infinity_are_refused_but_minus_infinity_is_a_ruled_out_token():
    """A damaged model's logits (NaN, +infinity) are refused in one line at a request's start;
    -infinity only rules a token out, as a model may."""
    from decodekit.errors import InvalidModel

    backend = tiny_llama(seed=0)
    ruled_out = torch.tensor([[0.5, -torch.inf, 1.0]])
    assert backend._finite(ruled_out) is ruled_out
    for bad in (torch.nan, torch.inf):
        with pytest.raises(InvalidModel, match="not finite"):
            backend._finite(torch.tensor([[0.5, bad, 1.0]]))
    backend.weights.final_norm[0] = torch.nan  # a damaged norm weight: every logit NaN
    with pytest.raises(InvalidModel, match="not finite"):
        backend.prefill([1, 2, 3])


def test_the_room_for_a_pass_is_what_the_context_has_left():
    """pass_room() is the context's length less the committed tokens: a tree of exactly that many
    nodes fits."""
    backend = tiny_llama(seed=0, max_position=16)
    backend.append(tokens(10))
    assert backend.pass_room() == 6
    backend.verify_tree(tokens(6, seed=3)[0], [-1, 0, 1, 2, 3, 4])
    backend.commit_path(range(6))
    assert backend.length == 16 and backend.pass_room() == 0


def prefix_reusing_llama():
    """A tiny Llama whose passes run the one-call layer path (head size 16), so that a prompt's
    rest read after a kept prefix gives the bits of the whole prompt (reuses_prefix)."""
    backend = tiny_llama(seed=0, hidden_size=64)
    if not backend.reuses_prefix():
        pytest.skip("needs the compiled kernels")
    return backend


def test_a_kept_prefix_is_taken_for_one_row_only():
    """prefill reuses the kept prefix only when it reads one row from a one-row cache: a prompt
    forked into several rows, or a cache holding several, is read afresh, with the same logits."""
    ids = tokens(12)[0].tolist()
    want = prefix_reusing_llama().prefill(ids)
    backend = prefix_reusing_llama()
    backend.prefill(ids[:8], batch_size=3)  # three rows held
    backend.kept_ids = ids[:8]
    assert backend.shared_prefix(ids) == 0
    assert torch.equal(backend.prefill(ids), want) and backend.batch_size == 1
    backend.kept_ids = ids[:8]
    forked = backend.prefill(ids, batch_size=3)  # the same prompt, forked: read afresh, three rows
    assert forked.shape == (3, want.shape[-1]) and backend.batch_size == 3 and backend.length == 12
    assert torch.equal(forked, want.expand(3, -1))


def test_a_prompt_that_reused_the_kept_prefix_leaves_nothing_kept():
    """kept_ids says what the cache holds: once a prompt took part of it and read its own rest, the
    cache holds that prompt, so a later prompt starting as the old kept tokens is read afresh."""
    first = tokens(12, seed=1)[0].tolist()
    second = first[:4] + [(t + 1) % 96 for t in first[4:]]  # shares its first four tokens only
    backend = prefix_reusing_llama()
    backend.prefill(first)
    backend.keep(first)
    assert backend.shared_prefix(second) == 4
    backend.prefill(second)
    assert backend.kept_ids is None
    again = first + [5]
    assert torch.equal(backend.prefill(again), prefix_reusing_llama().prefill(again))


def test_truncating_past_the_cached_length_is_refused(backend):
    """truncate rolls back; it cannot grow the cache: a length past what is cached is a ValueError, and the cache is kept."""
    backend.reset()
    backend.append(tokens(5))
    with pytest.raises(ValueError, match="cannot truncate a cache of 5 tokens to 6"):
        backend.truncate(6)
    assert backend.length == 5


def test_the_hf_backend_windows_no_layer_of_a_model_whose_layers_are_all_full_attention():
    """A config may keep a sliding_window while its layer_types list only full-attention layers (Dots1,
    or a Qwen2 config edited so): transformers then attends to every key, and so must the HF backend's mask."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).eval()
    model.config.sliding_window = 4  # kept, as Dots1's config keeps it
    assert set(model.config.layer_types) == {"full_attention"}
    ids = tokens(12)
    with torch.no_grad():
        want = model(ids).logits
    assert torch.allclose(HFBackend(model).append(ids).logits, want, atol=1e-5)


def test_a_folder_transformers_does_not_recognise_is_one_clear_error(tmp_path):
    """transformers refuses an unknown model_type with a ValueError: one InvalidModel line naming the folder."""
    import json

    from safetensors.torch import save_file

    from decodekit.errors import InvalidModel
    from decodekit.models.tiny import tiny_hf_config, tiny_state_dict

    save_file(tiny_state_dict(tiny_hf_config()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config() | {"model_type": "no_such_architecture"}))
    with pytest.raises(InvalidModel, match=rf"^{tmp_path}: transformers cannot load this model \(ValueError: ") as err:
        HFBackend.from_folder(tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, problem", [
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive number, got 0"),
    ({"rope_parameters": {"rope_theta": 0.0, "rope_type": "default"}}, "rope_theta must be a positive number, got 0.0"),
    ({"rope_parameters": {"rope_theta": float("inf"), "rope_type": "default"}},
     "rope_theta must be a positive number, got inf"),
    ({"max_position_embeddings": (1 << 24) + 1}, "max_position 16777217 is more than the 16777216 positions"),
])
def test_config_json_numbers_just_outside_their_ranges_are_refused(change, problem):
    """eps and the rotary base must be positive and finite (zero or infinity give NaN or constant
    angles), and the context at most MAX_POSITIONS: a value just outside is one ValueError."""
    import re

    from decodekit.models.llama_weights import LlamaConfig
    from decodekit.models.tiny import tiny_hf_config

    with pytest.raises(ValueError, match=re.escape(problem)):
        LlamaConfig.from_hf(tiny_hf_config() | change)


def test_a_context_of_exactly_max_positions_is_taken():
    """MAX_POSITIONS is the longest context the backend holds: a config.json that names exactly it is taken."""
    from decodekit.models.llama_weights import MAX_POSITIONS, LlamaConfig
    from decodekit.models.tiny import tiny_hf_config

    config = LlamaConfig.from_hf(tiny_hf_config() | {"max_position_embeddings": MAX_POSITIONS})
    assert config.max_position == MAX_POSITIONS


def test_a_window_on_some_of_the_listed_layers_is_refused_natively():
    """layer_types that name any sliding-attention layer (Qwen2 with max_window_layers mixes both):
    those layers attend to a window the native backend does not compute, so it refuses rather than
    running them as full attention; a list of full-attention layers only runs."""
    from decodekit.models.llama_weights import native_unsupported
    from decodekit.models.tiny import tiny_hf_config

    config = tiny_hf_config(max_position=128) | {"model_type": "qwen2", "sliding_window": 16,
                                                 "layer_types": ["full_attention", "sliding_attention"]}
    assert "a window of 16" in native_unsupported(config)
    assert native_unsupported(config | {"layer_types": ["full_attention", "full_attention"]}) is None


def test_keep_records_only_the_tokens_the_cache_holds():
    """keep(): the last token decoded is not read yet, so kept_ids stop at the cache's length."""
    backend = tiny_llama(seed=0)
    ids = tokens(6)[0].tolist()
    backend.prefill(ids[:5])
    backend.keep(ids)
    assert backend.kept_ids == ids[:5]


def test_a_kept_prefix_rolled_back_is_shared_only_as_far_as_the_cache_still_holds_it():
    """shared_prefix counts the kept tokens the cache still holds: after a rollback, only those
    before it, and the prompt read after them gives the logits of reading it whole."""
    ids = tokens(12)[0].tolist()
    backend = prefix_reusing_llama()
    backend.prefill(ids)
    backend.keep(ids)
    backend.truncate(6)
    assert backend.shared_prefix(ids + [3]) == 6
    assert torch.equal(backend.prefill(ids + [3]), prefix_reusing_llama().prefill(ids + [3]))


def test_own_clone_keeps_one_clone_per_other_backend_and_at_most_keep_of_them():
    """own_clone: each other backend gets a clone of its own (its weights, its own cache), the same
    one each time it is asked for, and only the ``keep`` most recently used are kept."""
    owner = tiny_llama(seed=0)
    others = [tiny_llama(seed=s) for s in (1, 2, 3)]
    ids = tokens(5)[0].tolist()
    first = owner.own_clone(others[0], "judge", keep=2)
    second = owner.own_clone(others[1], "judge", keep=2)
    assert first is not second and first is not others[0] and owner.own_clone(others[0], "judge", keep=2) is first
    for clone, other in ((first, others[0]), (second, others[1])):
        assert torch.equal(clone.prefill(ids), other.prefill(ids))
    owner.own_clone(others[2], "judge", keep=2)  # the second was the least recently used: dropped
    kept = {k[1] for k in owner._memory if isinstance(k, tuple) and k[0] == "judge.clone"}
    assert kept == {id(others[0]), id(others[2])}


def test_a_clone_holds_no_request_of_its_parent():
    """A clone starts with an empty cache and no request: its parent's request thread and
    should_stop (interrupt) are not its own."""
    backend = tiny_llama(seed=0)
    backend.interrupt = lambda: True
    backend.request_thread = 1
    twin = backend.clone()
    assert twin.interrupt is None and twin.request_thread is None
    twin.check_interrupt()  # nothing asks it to stop
    twin.prefill(tokens(5)[0].tolist())


def test_a_prompt_read_after_a_kept_prefix_has_its_logits_checked_too():
    """A request's first logits are refused when not finite, whether the whole prompt was read or
    only its rest after the kept prefix."""
    from decodekit.errors import InvalidModel

    ids = tokens(12)[0].tolist()
    backend = prefix_reusing_llama()
    backend.prefill(ids[:8])
    backend.keep(ids[:8])
    assert backend.shared_prefix(ids) == 8
    backend.weights.final_norm[0] = torch.nan  # damaged from here on: every logit NaN
    with pytest.raises(InvalidModel, match="not finite"):
        backend.prefill(ids)


def test_a_memory_familys_bound_leaves_the_other_families_alone():
    """``keep`` bounds one family (key[0]): values of another family are never dropped for it."""
    backend = tiny_llama(seed=0)
    backend.memory(("judge.clone", 1), lambda: "judge", keep=1)
    backend.memory(("draft.clone", 1), lambda: "draft", keep=1)
    backend.memory(("draft.clone", 2), lambda: "draft 2", keep=1)
    assert [k for k in backend._memory if isinstance(k, tuple)] == [("judge.clone", 1), ("draft.clone", 2)]


def test_truncating_to_zero_leaves_an_empty_cache_that_reads_a_new_sequence_as_a_fresh_one():
    """truncate(0) rolls everything back (a full cache keeps no floor): the cache then reads another
    sequence as a fresh cache does."""
    backend = tiny_llama(seed=0)
    backend.append(tokens(9))
    backend.truncate(0)
    assert (backend.length, backend.slots) == (0, 0)
    other = tokens(7, seed=4)
    assert torch.allclose(backend.append(other).logits, tiny_llama(seed=0).append(other).logits, atol=ATOL)


def test_reset_drops_a_pending_tree_and_the_last_passs_features():
    """After reset nothing of the last sequence is pending: a tree verified before it cannot be
    committed (its entries are gone), and no features of its passes are left for a drafter to read."""
    backend = tiny_llama(seed=0)
    backend.append(tokens(5))
    backend.verify_tree(tokens(3, seed=2)[0], [-1, 0, 1])
    assert backend.last_features is not None
    backend.reset()
    assert backend.last_features is None
    with pytest.raises(RuntimeError, match="verify_tree"):
        backend.commit_path([0, 1])
    assert backend.length == 0


def test_reset_forgets_the_kept_prefix():
    """kept_ids says what the cache holds: once it is reset and holds other tokens, a prompt that
    starts as the old kept tokens shares nothing with it and is read afresh."""
    first = tokens(12, seed=1)[0].tolist()
    backend = prefix_reusing_llama()
    backend.prefill(first)
    backend.keep(first)
    backend.reset()
    backend.append(torch.tensor([[(t + 1) % 96 for t in first[:6]]]))
    again = first + [5]
    assert backend.shared_prefix(again) == 0
    assert torch.equal(backend.prefill(again), prefix_reusing_llama().prefill(again))


def test_the_cache_bytes_of_several_rows_are_one_rows_times_the_rows():
    ids = tokens(8)[0].tolist()
    one, three = tiny_llama(seed=0), tiny_llama(seed=0)
    one.prefill(ids)
    three.prefill(ids, batch_size=3)
    c = one.config
    assert one.cache_bytes() == 2 * c.num_layers * c.num_kv_heads * 8 * c.head_dim * 4  # float32 keys and values
    assert three.cache_bytes() == 3 * one.cache_bytes()


def test_rows_are_checked_against_the_memory_the_cache_they_fork_takes(monkeypatch):
    """check_rows sizes the rows' cache as reorder allocates it, at the capacity already allocated
    (not only the entries filled so far): rows that would fit only by the filled entries are refused."""
    from decodekit.errors import InvalidParameter
    from decodekit.models import native

    backend = tiny_llama(seed=0)
    backend.append(tokens(10))
    c, capacity = backend.config, backend._k.shape[3]
    row = 2 * c.num_layers * c.num_kv_heads * capacity * c.head_dim * 4  # one row's float32 keys and values
    monkeypatch.setattr(native, "available_memory", lambda: 4 * row)
    backend.check_rows(4)
    with pytest.raises(InvalidParameter, match=f"^5 sequences of {capacity} positions need"):
        backend.check_rows(5)


def test_a_tree_reaching_the_first_position_of_a_new_rotary_chunk_matches_sequential_decoding():
    """A tree's deepest node can sit at the first position whose rotary angles no pass has needed
    yet (the tables fill ROPE_CHUNK positions at a time): the tree's pass computes them too."""
    from decodekit.models.llama_weights import ROPE_CHUNK

    context, chain = tokens(ROPE_CHUNK - 1), tokens(2, seed=3)
    backend = tiny_llama(seed=0, max_position=2 * ROPE_CHUNK)
    backend.append(context)
    tree = backend.verify_tree(chain[0], [-1, 0]).logits[0]  # positions ROPE_CHUNK - 1 and ROPE_CHUNK
    sequential = tiny_llama(seed=0, max_position=2 * ROPE_CHUNK).append(torch.cat([context, chain], dim=1))
    assert torch.allclose(tree, sequential.logits[0, -2:], atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_rms_norm_is_transformers_llama_rms_norm(dtype):
    """The norm the layer loop runs without the kernels: transformers' LlamaRMSNorm (eps under the
    root, the normalised rows rounded to the model's dtype before the weight multiplies them), on
    rows as small as eps, where leaving eps out would change them."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from decodekit.models.llama_weights import rms_norm

    gen = torch.Generator().manual_seed(3)
    reference = LlamaRMSNorm(64, eps=1e-2)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(64, generator=gen))
    reference = reference.to(dtype)
    x = (torch.randn(5, 64, generator=gen) * torch.tensor([1.0, 0.1, 0.03, 0.01, 3.0])[:, None]).to(dtype)
    with torch.no_grad():
        want = reference(x)
    got = rms_norm(x, reference.weight.detach(), 1e-2)
    assert got.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_weights_given_as_strided_views_give_the_logits_of_their_contiguous_copies():
    """A state dict may hold views (a transposed copy's transpose, a column of a wider tensor): the
    kernels read packed rows, so every weight is made contiguous first, and the logits are the
    contiguous weights' bit for bit."""
    from decodekit.models.llama_weights import LlamaConfig
    from decodekit.models.native import NativeLlama
    from decodekit.models.tiny import tiny_hf_config, tiny_state_dict

    config = tiny_hf_config(hidden_size=64)
    state = tiny_state_dict(config, seed=2)
    state = {name: t + 0.1 * torch.randn_like(t) if name.endswith("norm.weight") else t for name, t in state.items()}

    def strided(t):
        view = t.t().contiguous().t() if t.dim() == 2 else torch.stack([t, -t], dim=1)[:, 0]
        assert torch.equal(view, t) and not view.is_contiguous()
        return view

    ids = tokens(12)
    want = NativeLlama(LlamaConfig.from_hf(config), state).append(ids).logits
    got = NativeLlama(LlamaConfig.from_hf(config), {n: strided(t) for n, t in state.items()}).append(ids).logits
    assert torch.equal(got, want)


def test_a_bfloat16_tiny_llama_computes_in_bfloat16():
    f32, b16 = tiny_llama(seed=1), tiny_llama(seed=1, dtype=torch.bfloat16)
    assert b16.dtype == torch.bfloat16 and b16.weights.layers[0]["attn_norm"].dtype == torch.bfloat16
    ids = tokens(8)
    assert not torch.equal(f32.append(ids).logits, b16.append(ids).logits)  # rounded to bfloat16 on the way


def test_a_verified_tree_left_uncommitted_is_dropped_by_the_next_append_or_verification(backend):
    """A verified tree's entries stay uncommitted: an append (or another verification) after it
    without commit_path reads its tokens after the committed ones, as a fresh run of them does,
    and a truncate cannot reach past the committed length into the tree's entries."""
    context, nodes = tokens(5), tokens(3, seed=2)[0]
    reference = tiny_llama(seed=0).append(torch.cat([context, tokens(2, seed=3)], dim=1)).logits[:, -2:]
    backend.append(context)
    backend.verify_tree(nodes, [-1, 0, 1])
    with pytest.raises(ValueError, match="cannot truncate a cache of 5 tokens to 6"):
        backend.truncate(6)
    assert backend.length == 5
    backend.verify_tree(nodes, [-1, -1, 0])
    assert torch.allclose(backend.append(tokens(2, seed=3)).logits, reference, atol=ATOL)
    assert backend.length == 7


def test_a_commit_path_after_a_rollback_an_append_or_a_reset_is_refused_on_either_backend(backend):
    """Either backend forgets a verified tree once the cache changes (a truncate, an append, a reset):
    commit_path is then refused rather than committing whatever the tree's slots now hold."""
    for change in (lambda: backend.truncate(4), lambda: backend.append(tokens(1, seed=3)), lambda: backend.reset()):
        backend.reset()
        backend.append(tokens(5))
        backend.verify_tree(tokens(3, seed=2)[0], [-1, 0, 1])
        change()
        length = backend.length
        with pytest.raises(RuntimeError, match="verify_tree"):
            backend.commit_path([0])
        assert backend.length == length


def tiny_mistral(window: int = 4):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            sliding_window=window, max_position_embeddings=128)).eval()


def test_the_hf_backends_window_in_a_tree_counts_positions_not_slots():
    """In a verified tree a node's slot is its index, its position its depth: the window reaches back
    ``sliding_window`` positions along the node's path (a chain under siblings sits at slots past
    its positions), as transformers' own run of that path does."""
    model = tiny_mistral(window=4)
    backend = HFBackend(model)
    context = tokens(6)
    parents = [-1, -1, -1, -1, 0, 4, 5, 6, 7]  # siblings first, then a chain under node 0 deeper than the window
    node_tokens = tokens(len(parents), seed=4)[0]
    backend.append(context)
    tree = backend.verify_tree(node_tokens, parents).logits[0]
    for node in range(len(parents)):
        with torch.no_grad():
            want = model(torch.cat([context, node_tokens[path_to(node, parents)][None]], dim=1)).logits[0, -1]
        assert torch.allclose(tree[node], want, atol=1e-5), node


def test_the_hf_backends_hidden_states_are_the_native_backends():
    """hidden_layers names the same layers on either backend (0: the embeddings, i: after layer i;
    the last layer's entry is left out: transformers' is after the final norm)."""
    ids = tokens(9)
    layers = (0, 1, 2)
    native = tiny_llama(seed=4, num_layers=3).append(ids, hidden_layers=layers).hidden
    hf = HFBackend(tiny_hf_model(seed=4, num_layers=3)).append(ids, hidden_layers=layers).hidden
    assert set(hf) == set(native) == set(layers)
    for layer in layers:
        assert torch.allclose(hf[layer], native[layer], atol=ATOL), layer


def test_the_hf_backend_loads_a_folder_in_the_dtype_asked_for(tmp_path):
    """from_folder's dtype is the dtype the model computes in, whatever the dtype its weights were saved in."""
    import json

    from safetensors.torch import save_file

    from decodekit.models.tiny import tiny_hf_config, tiny_state_dict

    save_file(tiny_state_dict(tiny_hf_config()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config() | {"torch_dtype": "float32"}))
    backend = HFBackend.from_folder(tmp_path, dtype=torch.bfloat16)
    assert backend.dtype == torch.bfloat16 and backend.info.dtype == torch.bfloat16
    assert backend.append(tokens(4)).logits.isfinite().all()


def test_transformers_verbosity_is_restored_after_a_quiet_load_even_a_failed_one():
    from transformers.utils import logging as transformers_logging

    from decodekit.models.hf import quietly_loaded

    before = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_info()
    try:
        assert quietly_loaded(lambda: transformers_logging.get_verbosity()) == transformers_logging.ERROR
        assert transformers_logging.get_verbosity() == transformers_logging.INFO

        def failing():
            raise OSError("no weights")

        with pytest.raises(OSError, match="no weights"):
            quietly_loaded(failing)
        assert transformers_logging.get_verbosity() == transformers_logging.INFO
    finally:
        transformers_logging.set_verbosity(before)


def test_swish_is_silu_to_the_native_backend():
    from decodekit.models.llama_weights import native_unsupported

    assert native_unsupported({"hidden_act": "swish"}) is None
    assert native_unsupported({"hidden_act": "gelu"}) is not None


def test_restoring_no_tokens_of_a_cached_prefix_is_refused():
    b = tiny_llama(seed=0, hidden_size=64, max_position=256)  # head size 16: the kernels' stack
    b.prefill([1, 2, 3, 4])
    b.keep([1, 2, 3, 4])
    prefix = b.snapshot()
    assert prefix is not None
    b.clone().restore(prefix, 1)
    with pytest.raises(ValueError, match="cannot restore 0 tokens"):
        b.clone().restore(prefix, 0)


def test_a_cache_of_several_sequences_gives_no_snapshot():
    """A prompt cache's entry is one sequence's entries: a cache forked into several rows (a search's
    beams) after its prompt was kept gives none, rather than an entry no batch-1 cache can take."""
    backend = tiny_llama(seed=0, hidden_size=64)
    backend.prefill([5, 6, 7, 8])
    backend.keep([5, 6, 7, 8])
    assert backend.snapshot() is not None
    backend.reorder(torch.tensor([0, 0, 0]))
    assert backend.batch_size == 3 and backend.kept_ids == [5, 6, 7, 8]
    assert backend.snapshot() is None


@pytest.mark.parametrize("method, params", [("greedy", {}), ("sample", {"top_k": 2, "seed": 0}),
                                            ("sample", {"top_h": 0.9, "seed": 0}), ("pld", {})])
def test_logits_that_turn_nan_mid_answer_are_a_damaged_model_not_an_answer(method, params):
    """A NaN (or +infinity) in any pass's logits, not only the prompt's, is the model's fault in one
    line: greedy's argmax took the NaN token, top-k dropped the real k-th token beside it and top-H
    kept the least likely one, each an answer with no error."""
    from decodekit.engine import Engine
    from decodekit.errors import InvalidModel
    from decodekit.models import CharTokenizer, LoadedModel

    backend = tiny_llama(seed=0, hidden_size=64)
    head, passes = backend.weights.lm_head, []

    def failing(h):
        passes.append(1)
        logits = head(h)
        if len(passes) >= 3:  # the prompt's pass and one step go through
            logits = logits.clone()
            logits[..., 5] = float("nan")
        return logits

    backend.weights.lm_head = failing
    with pytest.raises(InvalidModel, match="the model's logits are not finite"):
        Engine(LoadedModel(backend, CharTokenizer(96), "tiny")).generate(
            "hello", method=method, max_new_tokens=8, ignore_eos=True, chat=False, **params)
    assert len(passes) >= 3
