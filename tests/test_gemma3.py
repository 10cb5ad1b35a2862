"""Gemma 3 on the native backend: transformers' Gemma3ForCausalLM with the same weights is the
reference; sliding-window layers, sandwich norms, q/k norms and the scaled embedding all count."""

from __future__ import annotations

import pytest
import torch

from decodekit.engine import Engine
from decodekit.errors import InvalidModel, InvalidParameter
from decodekit.models import LoadedModel, kernels
from decodekit.models.backend import tree_ancestor_mask
from decodekit.models.gemma3 import Gemma3Config
from decodekit.models.tiny import tiny_gemma3, tiny_gemma3_hf_config, tiny_gemma3_hf_model
from decodekit.models.tokenizer import CharTokenizer

ATOL = 1e-4


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def test_config_reads_the_layer_kinds_and_their_rotary_bases():
    c = Gemma3Config.from_hf(tiny_gemma3_hf_config(num_layers=4, sliding_window=8))
    assert c.local_layers == (True, False, True, False)
    assert (c.rope_theta, c.local_rope_theta, c.sliding_window) == (1e6, 1e4, 8)
    assert c.query_scale == 24**-0.5
    # the older spelling, no layer_types: every sliding_window_pattern-th layer is global (the
    # reference's rule: layer i is local where (i + 1) % pattern != 0)
    older = {k: v for k, v in tiny_gemma3_hf_config(num_layers=6).items() if k != "layer_types"}
    assert Gemma3Config.from_hf(older).local_layers == (True, True, True, True, True, False)
    assert Gemma3Config.from_hf({**older, "sliding_window_pattern": 3}).local_layers == (True, True, False) * 2
    scaled = tiny_gemma3_hf_config()
    scaled["rope_parameters"]["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    with pytest.raises(NotImplementedError, match="linear"):
        Gemma3Config.from_hf(scaled)


def test_a_config_that_does_not_say_ties_the_head_as_transformers_gemma3_does():
    """Google's Gemma 3 config.json files leave tie_word_embeddings out and hold no lm_head:
    transformers' Gemma 3 ties by default (Llama's does not), and so does this config."""
    from transformers import Gemma3TextConfig

    silent = {k: v for k, v in tiny_gemma3_hf_config().items() if k != "tie_word_embeddings"}
    assert Gemma3TextConfig().tie_word_embeddings is True
    assert Gemma3Config.from_hf(silent).tie_word_embeddings is True
    assert Gemma3Config.from_hf({**silent, "tie_word_embeddings": False}).tie_word_embeddings is False


@pytest.mark.parametrize("left_out", ["head_dim", "num_key_value_heads", "max_position_embeddings",
                                      "query_pre_attn_scalar", "sliding_window", "rms_norm_eps"])
def test_a_config_that_leaves_a_key_out_reads_as_transformers_reads_it(left_out):
    """A hand-written config may leave out a key transformers' Gemma3TextConfig has a default for:
    the model read is the one transformers reads (Gemma's defaults, not a Llama's reading of the sizes)."""
    from transformers import Gemma3TextConfig

    given = {k: v for k, v in tiny_gemma3_hf_config().items() if k != left_out}
    assert Gemma3Config.from_hf(given) == Gemma3Config.from_hf(Gemma3TextConfig(**given).to_dict())


@pytest.mark.parametrize("window", [8, 64])
def test_native_logits_match_transformers(window):
    """40 tokens against a window of 8: local layers must drop the keys that fell out of it."""
    native, hf = tiny_gemma3(seed=3, sliding_window=window), tiny_gemma3_hf_model(seed=3, sliding_window=window)
    ids = tokens(40)
    with torch.no_grad():
        ref = hf(ids).logits
    whole = native.append(ids).logits
    native.reset()
    pieces = [native.append(ids[:, :13]).logits] + [native.append(ids[:, i : i + 1]).logits for i in range(13, 40)]
    for got in (whole, torch.cat(pieces, dim=1)):
        assert torch.allclose(got, ref, atol=ATOL)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_attention_bias_gives_q_k_v_and_o_their_biases_as_transformers_does():
    """transformers' Gemma 3 gives all four attention projections a bias under attention_bias (a
    Llama's rule, not Qwen2's, whose o has none): the native backend adds o's too."""
    native, hf = tiny_gemma3(seed=4, attention_bias=True), tiny_gemma3_hf_model(seed=4, attention_bias=True)
    assert native.config.output_bias and any(name.endswith("o_proj.bias") for name in hf.state_dict())
    ids = tokens(24)
    with torch.no_grad():
        assert torch.allclose(native.append(ids).logits, hf(ids).logits, atol=ATOL)


@pytest.mark.parametrize("hidden_layers", [(), (1,)])
def test_passes_of_two_tokens_past_the_window_give_transformers_logits(hidden_layers):
    """A pass of positions p and p + 1: the first row's window starts one key before the second's,
    which must not see that key (p + 1 - j < window); through forward.c and through the layer loop
    (hidden states asked for), whose mask skips what no row can see."""
    native, hf = tiny_gemma3(seed=3, sliding_window=8), tiny_gemma3_hf_model(seed=3, sliding_window=8)
    ids = tokens(40)
    with torch.no_grad():
        ref = hf(ids).logits
    pieces = [native.append(ids[:, :12], hidden_layers=hidden_layers).logits]
    pieces += [native.append(ids[:, i : i + 2], hidden_layers=hidden_layers).logits for i in range(12, 40, 2)]
    assert torch.allclose(torch.cat(pieces, dim=1), ref, atol=ATOL)


def test_a_prompt_longer_than_a_chunk_is_read_in_chunks_with_transformers_logits(monkeypatch):
    """A long prompt is read in chunks, the kernels' 64 rows a pass, or through torch (hidden states
    asked for) ``LONG_PROMPT_CHUNK`` a pass (a window's mask over the whole of it grows with its
    square): every position's logits still are transformers' on the whole prompt."""
    from decodekit.models import gemma3

    monkeypatch.setattr(gemma3, "LONG_PROMPT_CHUNK", 48)
    native = tiny_gemma3(seed=3, sliding_window=8)
    hf = tiny_gemma3_hf_model(seed=3, sliding_window=8)
    ids = tokens(130)
    passes = []
    monkeypatch.setattr(native, "_forward", lambda tokens, *args, **kw: passes.append(tokens.shape[1])
                        or type(native)._forward(native, tokens, *args, **kw))
    with torch.no_grad():
        ref = hf(ids).logits
    got = native.append(ids).logits
    assert passes == [64, 64, 2] and torch.allclose(got, ref, atol=ATOL)
    native.reset()
    passes.clear()
    got = native.append(ids, hidden_layers=(1,)).logits
    assert passes == [48, 48, 34] and torch.allclose(got, ref, atol=ATOL)


def test_final_logit_softcapping_caps_the_logits_at_tanh_of_their_ratio_to_the_cap():
    """``final_logit_softcapping`` c: the logits are c * tanh(logits / c), as the reference caps them
    (None in Gemma 3, but a config may set it)."""
    from decodekit.models.gemma3 import NativeGemma3

    state = dict(tiny_gemma3_hf_model(seed=3).state_dict())
    state.pop("lm_head.weight", None)
    config = tiny_gemma3_hf_config()
    plain = NativeGemma3(Gemma3Config.from_hf(config), state, name="plain")
    capped = NativeGemma3(Gemma3Config.from_hf({**config, "final_logit_softcapping": 2.0}), state, name="capped")
    ids = tokens(12)
    raw = plain.append(ids).logits
    assert raw.abs().max() > 2.0  # the cap bends them
    assert torch.allclose(capped.append(ids).logits, 2.0 * torch.tanh(raw / 2.0), atol=1e-5)


def test_the_window_matters():
    """The same weights with a window that covers everything give other logits past the window."""
    ids = tokens(30)
    narrow, wide = tiny_gemma3(seed=2, sliding_window=8), tiny_gemma3(seed=2, sliding_window=64)
    a, b = narrow.append(ids).logits[0], wide.append(ids).logits[0]
    assert torch.equal(a[:8], b[:8])
    assert not torch.allclose(a[8:], b[8:], atol=1e-3)


@pytest.mark.parametrize("parents", [
    [-1, 0, 0, 1, 2, 4, 5, 6, 3],  # paths deeper than the window's reach from the context
    # a chain deeper than the window behind a sibling: a node's slot (its index) is past its
    # position (its depth), and node 12 (depth 11) must not see node 4 (depth 3) in its own slot 4
    [-1, 0, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
])
def test_tree_nodes_are_bit_identical_to_one_token_steps_across_the_window(parents):
    backend = tiny_gemma3(seed=1, sliding_window=8)
    context, node_tokens = tokens(20), tokens(len(parents), seed=7)[0]
    backend.append(context)
    tree = backend.verify_tree(node_tokens, parents).logits[0]
    on_path = tree_ancestor_mask(parents)  # row i: node i and its ancestors, root first in index order
    for node in range(len(parents)):
        backend.reset()
        backend.append(context)
        for token in node_tokens[on_path[node]]:
            step = backend.append(token.view(1, 1)).logits[0, -1]
        assert torch.equal(step, tree[node]), node


def test_a_pass_without_a_mask_in_forward_c_still_keeps_each_rows_window():
    """forward.c reads no mask (None) as every key for every row, an all-true mask as the same; a
    sliding-window layer still keeps each row to its own window, the later row seeing one key fewer
    than the first: both give the same bits."""
    backend = tiny_gemma3(seed=3, sliding_window=8)
    assert backend._stack is not None
    backend.append(tokens(20))
    start, rows = backend._slots, 2
    backend._ensure_capacity(start + rows)
    positions = torch.arange(start, start + rows)
    x = backend._embed(tokens(rows, seed=5))[0]
    results = []
    for visible in (None, torch.ones(rows, start + rows, dtype=torch.bool)):
        out, pending = x.clone(), torch.empty_like(x)
        k_cache, v_cache = backend._k[:, 0].clone(), backend._v[:, 0].clone()
        assert backend._stack.run(out, pending, backend._freqs_pairs, positions, visible, k_cache, v_cache, start)
        results.append(out + pending)
    assert torch.equal(results[0], results[1])


def test_the_one_call_layer_path_gives_the_layer_loops_bits():
    """Decode steps and trees go through forward.c (Gemma's fields: q/k norms, separate windows,
    per-layer rotary tables, sandwich norms, GeLU gating); asking for hidden states takes the Python
    loop over the same kernels. The two agree bit for bit, inside and past the window."""
    one_call, loop = tiny_gemma3(seed=6, sliding_window=8), tiny_gemma3(seed=6, sliding_window=8)
    assert one_call._stack is not None
    context = tokens(20)
    one_call.append(context), loop.append(context)
    for token in tokens(6, seed=3)[0]:
        step = token.view(1, 1)
        assert torch.equal(one_call.append(step).logits, loop.append(step, hidden_layers=(1,)).logits)
    node_tokens, parents = tokens(5, seed=4)[0], [-1, 0, 1, 1, 3]
    tree = one_call.verify_tree(node_tokens, parents).logits
    loop._stack = None  # the same tree through the layer loop
    assert torch.equal(tree, loop.verify_tree(node_tokens, parents).logits)


def mixed_blocks_gemma3(seed: int):
    """A tiny Gemma 3 on GGUF blocks whose v projections are Q8_0 beside Q4_1 q and k (as the
    embedded Gemma's file mixes kinds): three projections, joined row by row in forward.c."""
    from decodekit.models.gemma3 import NativeGemma3
    from decodekit.models.gguf_blocks import BlockMatrix
    from decodekit.models.tiny import as_gguf_blocks

    state = dict(tiny_gemma3_hf_model(seed).state_dict())
    state.pop("lm_head.weight", None)
    state, blocks = as_gguf_blocks(state)
    for name in [n for n in state if n.endswith("v_proj.weight")]:
        blocks[name] = BlockMatrix.quantize(state[name], "q8_0")
        state[name] = blocks[name].dequantize()
    return NativeGemma3(Gemma3Config.from_hf(tiny_gemma3_hf_config()), state, gguf_blocks=blocks)


def test_q_k_and_v_on_blocks_of_different_types_give_the_layer_loops_bits():
    """Separate q, k and v projections are joined into each row's qkv (q, then k, then v) before
    the norms and attention, in forward.c as in the Python loop."""
    one_call, loop = mixed_blocks_gemma3(seed=6), mixed_blocks_gemma3(seed=6)
    if one_call._stack is None:
        pytest.skip("kernels unavailable on this machine")
    loop._stack = None
    context = tokens(12)
    one_call.append(context), loop.append(context)
    for token in tokens(4, seed=3)[0]:
        step = token.view(1, 1)
        assert torch.equal(one_call.append(step).logits, loop.append(step).logits)
    assert torch.equal(one_call._v[:, :, :, : one_call.length], loop._v[:, :, :, : loop.length])


def test_rollback_then_append_equals_a_fresh_run():
    backend, ids = tiny_gemma3(seed=4), tokens(30)
    fresh = backend.append(ids).logits
    backend.reset()
    backend.append(ids[:, :20])
    backend.append(tokens(9, seed=9))
    backend.truncate(20)
    assert torch.allclose(backend.append(ids[:, 20:]).logits, fresh[:, 20:], atol=ATOL)


NUMERICS = ["exact"] + (["fast"] if kernels.integer_block_matmul("q4_1") is not None else [])


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("method", ["pld", "recycling", "lookahead", "layerskip", "kvdraft"])
def test_lossless_methods_are_token_identical_to_greedy(method, numerics):
    engine = Engine(LoadedModel(tiny_gemma3(seed=5, numerics=numerics), CharTokenizer(96), "tiny-gemma3"))
    prompt = "abcabcabcabc the cat sat on the mat, the cat sat on the"
    greedy = engine.generate(prompt, method="greedy", max_new_tokens=40, chat=False)
    other = engine.generate(prompt, method=method, max_new_tokens=40, chat=False)
    assert other.tokens == greedy.tokens


def test_kvdraft_with_a_draft_cache_gemma_cannot_hold_names_what_it_can():
    """The refusal names draft_cache and what kvdraft drafts through on Gemma (it suggested full,
    which kvdraft refuses)."""
    from decodekit.errors import InvalidParameter

    engine = Engine(LoadedModel(tiny_gemma3(seed=0), CharTokenizer(96), "tiny-gemma3"))
    with pytest.raises(InvalidParameter, match=r"^draft_cache snapkv:budget=16,window=4: .*sink:S,window:W or int8$") as refused:
        engine.generate("abc abc abc", method="kvdraft", draft_cache="snapkv:budget=16,window=4", max_new_tokens=5,
                        chat=False)
    assert refused.value.param == "draft_cache" and "full" not in str(refused.value)


def test_the_hf_backend_runs_gemma_past_its_window_as_the_native_one_does():
    """--backend hf keeps every key in every layer and gives the sliding-window layers a mask of
    their own: decode steps past the window, a rollback and speculative trees agree with the
    native backend (itself checked against transformers above)."""
    from decodekit.models.hf import HFBackend

    native, hf = tiny_gemma3(seed=3, sliding_window=8), HFBackend(tiny_gemma3_hf_model(seed=3, sliding_window=8))
    ids = tokens(30)
    assert torch.allclose(hf.append(ids[:, :20]).logits, native.append(ids[:, :20]).logits, atol=ATOL)
    for t in range(20, 30):
        assert torch.allclose(hf.append(ids[:, t : t + 1]).logits, native.append(ids[:, t : t + 1]).logits, atol=ATOL), t
    hf.truncate(12), native.truncate(12)
    assert torch.allclose(hf.append(ids[:, 12:16]).logits, native.append(ids[:, 12:16]).logits, atol=ATOL)
    engine = Engine(LoadedModel(hf, CharTokenizer(96), "tiny-gemma3-hf"))
    prompt = "abcabcabcabc the cat sat on the mat, the cat sat on the"
    greedy = engine.generate(prompt, method="greedy", max_new_tokens=30, chat=False)
    assert engine.generate(prompt, method="pld", max_new_tokens=30, chat=False).tokens == greedy.tokens
    native_engine = Engine(LoadedModel(tiny_gemma3(seed=3, sliding_window=8), CharTokenizer(96), "tiny-gemma3"))
    assert native_engine.generate(prompt, method="greedy", max_new_tokens=30, chat=False).tokens == greedy.tokens


def test_a_sequence_past_the_context_is_not_pointed_to_a_cache_gemma_refuses():
    backend = tiny_gemma3(seed=1, sliding_window=8)
    with pytest.raises(ValueError, match=r"exceeds the model's context of 512$"):
        backend.prefill(tokens(600)[0].tolist())


def gguf_header(architecture: str | None, path) -> str:
    """A file holding only a GGUF header whose first entry is ``general.architecture`` (or, for
    None, another key): what the loader reads before anything is dequantised."""
    import struct

    key, value = (b"general.architecture", architecture.encode()) if architecture else (b"general.name", b"x")
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    path.write_bytes(header + struct.pack("<IQ", 8, len(value)) + value)
    return str(path)


def test_a_cache_gemma_cannot_take_is_refused_before_its_gguf_is_dequantised(tmp_path):
    """The policy is checked against the file's architecture, read from its header, before the
    loader dequantises it into the cache (about 20 s for the embedded Gemma, the first time): here
    the file holds a header alone, so anything read past it would fail otherwise."""
    from decodekit.models import load_model
    from decodekit.models.loading import gguf_architecture

    gemma = gguf_header("gemma3", tmp_path / "gemma.gguf")
    assert gguf_architecture(gemma) == "gemma3" and gguf_architecture(gguf_header(None, tmp_path / "x.gguf")) is None
    with pytest.raises(InvalidParameter, match="not supported for Gemma 3"):
        load_model(gemma, kv_cache="sink:4,window:16")
    with pytest.raises(InvalidModel, match="cannot be read as a GGUF model"):  # int8 it takes: the loader reads on
        load_model(gemma, kv_cache="int8")


@pytest.mark.parametrize("cache", ["sink:4,window:16", "int4"])
def test_cache_policies_that_move_entries_or_read_codes_before_every_row_are_refused(cache):
    with pytest.raises(InvalidParameter, match="sliding-window"):
        tiny_gemma3(seed=0).with_kv_cache(cache)


def test_the_older_spelling_reads_the_local_rotary_base_from_rope_local_base_freq():
    """Configs without ``rope_parameters`` (Gemma 3's own): ``rope_theta`` is the global layers' base,
    ``rope_local_base_freq`` the sliding-window layers'."""
    older = {k: v for k, v in tiny_gemma3_hf_config(num_layers=2).items() if k != "rope_parameters"}
    c = Gemma3Config.from_hf({**older, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert (c.rope_theta, c.local_rope_theta) == (1e6, 1e4)


def test_a_pass_longer_than_the_kernels_rows_gives_transformers_logits():
    """A 100-token pass with hidden states asked for goes through torch (rotary tables, GeGLU with
    tanh, the window's mask), not the kernels: still transformers' logits."""
    native, hf = tiny_gemma3(seed=3, sliding_window=8), tiny_gemma3_hf_model(seed=3, sliding_window=8)
    ids = tokens(100)
    with torch.no_grad():
        ref = hf(ids).logits
    assert torch.allclose(native.append(ids, hidden_layers=(1,)).logits, ref, atol=ATOL)


def test_a_multimodal_config_json_is_read_from_its_text_config():
    """Gemma 3 4B and up ship Gemma3ForConditionalGeneration's config.json: the text model's fields
    sit under ``text_config``, which is what the native backend reads."""
    from transformers import Gemma3Config as HFGemma3Config, Gemma3TextConfig

    text = tiny_gemma3_hf_config(sliding_window=8)
    outer = HFGemma3Config(text_config=Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"}))
    config = outer.to_dict()
    assert "num_hidden_layers" not in config  # only the text_config holds the sizes
    assert Gemma3Config.from_hf(config) == Gemma3Config.from_hf(text)


@pytest.mark.parametrize("change", [
    {"attn_logit_softcapping": 50.0},  # Gemma 2's attention soft-capping, not computed here
    {"hidden_activation": "gelu"},  # exact GeLU, where the kernels compute the tanh approximation
    {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}}},
], ids=["attention-softcap", "exact-gelu", "local-rope-scaling"])
def test_a_config_asking_for_what_the_native_backend_does_not_compute_is_refused(change):
    """transformers computes each of these otherwise than the native layers would: refused in one
    line, never run as plain Gemma 3 (other logits without a word)."""
    with pytest.raises(NotImplementedError, match="not supported by the native backend"):
        Gemma3Config.from_hf({**tiny_gemma3_hf_config(), **change})


def test_a_bfloat16_embedding_is_scaled_by_the_square_root_rounded_to_bfloat16_as_transformers_does():
    """The reference multiplies the embedding rows by sqrt(hidden_size) cast to the model's dtype
    first: with hidden size 48 (sqrt not a bfloat16 value) the rows are transformers' bit for bit."""
    native = tiny_gemma3(seed=3, dtype=torch.bfloat16, hidden_size=48)
    hf = tiny_gemma3_hf_model(seed=3, hidden_size=48).to(torch.bfloat16)
    assert native.dtype == torch.bfloat16
    ids = tokens(30)
    with torch.no_grad():
        want = hf.model.embed_tokens(ids)[0].float()
    assert torch.equal(native.token_embeddings(ids[0]), want)


def test_the_int8_cache_holds_the_quantised_rows_of_the_full_caches_keys_and_values():
    """Under the int8 cache Gemma's layers run with the int8 kernels (its rows are codes and a
    scale, not head_dim floats): layer 0's stored keys and values are the full cache's quantised,
    and the logits stay close to transformers' past the window."""
    from decodekit.models.kernels import quantise_int8_rows

    full = tiny_gemma3(seed=3, sliding_window=8)
    int8 = full.with_kv_cache("int8")
    hf = tiny_gemma3_hf_model(seed=3, sliding_window=8)
    ids = tokens(30)
    with torch.no_grad():
        ref = hf(ids).logits
    full.append(ids[:, :20])
    got = [int8.append(ids[:, :20]).logits]
    for i in range(20, 30):
        full.append(ids[:, i : i + 1])
        got.append(int8.append(ids[:, i : i + 1]).logits)
    for mine, theirs in ((int8._k, full._k), (int8._v, full._v)):
        assert torch.equal(mine[0, 0, :, :30].view(torch.int32), quantise_int8_rows(theirs[0, 0, :, :30]).view(torch.int32))
    got = torch.cat(got, dim=1)
    assert (got - ref).abs().max() < 0.5 and torch.equal(got.argmax(-1), ref.argmax(-1))


def test_the_older_spelling_without_bases_reads_transformers_defaults():
    """A config with neither rope_parameters, rope_theta nor rope_local_base_freq: Gemma3TextConfig's
    defaults, 1e6 for the global layers and 1e4 for the local ones."""
    older = {k: v for k, v in tiny_gemma3_hf_config(num_layers=2).items() if k != "rope_parameters"}
    c = Gemma3Config.from_hf(older)
    assert (c.rope_theta, c.local_rope_theta) == (1e6, 1e4)
