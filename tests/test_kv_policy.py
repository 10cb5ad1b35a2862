"""KV-cache policies: each keeps exactly what its rule says (rules checked against slow loops,
the attention they rank by checked against transformers), the cache stays usable (rollback,
speculation, past the context window), and ``kvdraft`` stays lossless."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.engine import Engine
from decodekit.errors import InvalidParameter, PromptTooLong
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.kv_policy import (
    HeavyHitterPolicy, KiviPolicy, KVPolicy, SnapKVPolicy, StreamingPolicy, heavy_hitter_keep, parse_kv_cache,
    snapkv_keep, streaming_keep,
)
from decodekit.models.tiny import tiny_hf_model, tiny_llama

# hidden 64: head_dim 16, the compiled kernels' path; hidden 32: head_dim 8, torch's path
SIZES = [32, 64]


def tokens(n: int, seed: int = 0, vocab: int = 96) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Spellings ------------------------------------------------------------------------------------------


def test_spellings_parse_and_round_trip():
    assert parse_kv_cache("full") == KVPolicy() and not KVPolicy().evicts()
    assert parse_kv_cache("sink:4,window:64") == StreamingPolicy(4, 64)
    assert parse_kv_cache("sink:0,window:8,every:2") == StreamingPolicy(0, 8, 2)
    assert parse_kv_cache("h2o:budget=128,window=16") == HeavyHitterPolicy(128, 16)
    assert parse_kv_cache("snapkv:budget=100,window=8,kernel=3") == SnapKVPolicy(100, 8, 3)
    assert parse_kv_cache("int4") == KiviPolicy(32, 128) and parse_kv_cache("int4:residual=64") == KiviPolicy(32, 64)
    assert parse_kv_cache("int4").code_bits == 4 and parse_kv_cache("int8").code_bits == 8 and KVPolicy().code_bits is None
    assert parse_kv_cache("int2") == KiviPolicy(32, 128, bits=2) and parse_kv_cache("int2").kivi
    for spec in ("full", "int8", "int4", "int4:group=8,residual=64", "int2", "int2:group=16,residual=96", "sink:4,window:64", "sink:1,window:8,every:2", "h2o:budget=128,window=16",
                 "snapkv:budget=100,window=8", "snapkv:budget=100,window=8,kernel=3"):
        assert parse_kv_cache(spec).spec == spec


@pytest.mark.parametrize("spec", [
    "ful", "sink:4", "sink:x,window:4", "sink:4,window:0", "h2o:budget=8", "h2o:budget=8,window=9",
    "h2o:budget=8,window=4,extra=1", "snapkv:budget=8,window=8", "snapkv:budget=8,window=2,kernel=4",
    "sink:4,window:8,window:9", "h2o:budget=-1,window=1", "int4:residual=32", "int4:group=0", "int4:bits=2", "int3",
    "int4:group=99999999999999999999", "int2:residual=2147483648", "h2o:budget=99999999999999999999,window=4",
    "snapkv:window=8", "sink:,window:4", "int4:",
    # a spelling's fields are all read: none ignored, every one the syntax needs given, none out of the rule's range
    "h2o:budget=128", "full:budget=8", "full:", "int8:group=8", "int8:", "sink", "sink:", "h2o:budget=8,window=0",
    "snapkv:budget=8,window=0",
])
def test_bad_spellings_fail_in_one_line(spec):
    with pytest.raises(InvalidParameter) as err:
        parse_kv_cache(spec)
    assert "\n" not in str(err.value) and "kv cache" in str(err.value)


@pytest.mark.parametrize("spec, expected", [
    # a field given twice: said so, as --opt says it, not "cannot read"
    ("int4:group=32,group=16", "group is given twice; give one"),
    ("h2o:budget=8,window=4,budget=9", "budget is given twice; give one"),
    ("sink:4,sink:5,window:8", "sink is given twice; give one"),
    ("sink:4,window:8,window:9", "window is given twice; give one"),
    # a value out of the policy's range: the field and its value named, a negative one too
    ("sink:-1,window:10", "sink must be a non-negative integer, got -1"),
    ("sink:4,window:0", "window must be at least 1, got 0"),
    ("sink:4,window:-3", "window must be at least 1, got -3"),
    ("sink:4,window:8,every:-1", "every must be at least 1 (or 0: window // 8), got -1"),
    ("h2o:budget=8,window=0", "window must be at least 1, got 0"),
    ("h2o:budget=-1,window=1", "budget must be at least the window (1), got -1"),
    ("h2o:budget=8,window=9", "budget must be at least the window (9), got 8"),
    ("snapkv:budget=8,window=0", "window must be at least 1, got 0"),
    ("snapkv:budget=8,window=8", "budget must be more than the window (8), got 8"),
    ("snapkv:budget=-5", "budget must be more than the window (32), got -5"),
    ("snapkv:budget=100,window=2,kernel=4", "kernel must be a positive odd number, got 4"),
    ("snapkv:budget=100,window=2,kernel=-1", "kernel must be a positive odd number, got -1"),
    ("int4:group=0", "group must be at least 1, got 0"),
    ("int4:group=-2", "group must be at least 1, got -2"),
    ("int2:residual=16", "residual must be at least 64 (the longest pass), got 16"),
    ("int4:residual=-1", "residual must be at least 64 (the longest pass), got -1"),
])
def test_a_bad_field_is_named_with_its_value(spec, expected):
    with pytest.raises(InvalidParameter) as err:
        parse_kv_cache(spec)
    assert str(err.value).startswith("kv cache '") and str(err.value).endswith(expected), str(err.value)


def test_every_policys_spelling_reads_back_as_the_same_policy():
    """``spec`` is what logs, the cost table and the server name a cache by: read back, it must give the
    same policy, a default group with another residual (or the reverse) included."""
    for policy in (KiviPolicy(32, 64), KiviPolicy(32, 256, bits=2), KiviPolicy(16, 128), KiviPolicy(8, 64, bits=2),
                   StreamingPolicy(0, 8, 2), StreamingPolicy(4, 64), HeavyHitterPolicy(16, 16), SnapKVPolicy(100, 8, 7)):
        assert parse_kv_cache(policy.spec) == policy, policy


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_a_kivi_policy_of_other_than_4_or_2_bits_is_refused(bits):
    """KIVI's codes are packed 16 channels in ``2 * bits`` bytes for 4 and 2 bits only (int8 is its own
    per-token policy): a KiviPolicy of another width is refused when made, in one line."""
    with pytest.raises(InvalidParameter, match=f"bits must be 4 or 2, got {bits}"):
        KiviPolicy(bits=bits)


def test_a_field_of_exactly_the_limit_is_accepted():
    """The fields are refused past FIELD_LIMIT (the kernels' 32-bit counts), and FIELD_LIMIT itself is
    still in range ("at most")."""
    from decodekit.models.kv_policy import FIELD_LIMIT

    assert parse_kv_cache(f"h2o:budget={FIELD_LIMIT},window=4") == HeavyHitterPolicy(FIELD_LIMIT, 4)
    assert parse_kv_cache(f"sink:4,window:{FIELD_LIMIT}").window == FIELD_LIMIT


# The rules against slow loops --------------------------------------------------------------------------


def slow_streaming(n: int, sink: int, window: int) -> list[int]:
    return [i for i in range(n) if i < sink or i >= n - window]


def slow_top(scores: list[float], count: int) -> list[int]:
    """The ``count`` largest, earlier first among equals, as a sorted list of indices."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return sorted(order[:count])


def test_streaming_rule():
    for n in range(0, 40):
        assert streaming_keep(n, 3, 10).tolist() == slow_streaming(n, 3, 10)


def test_heavy_hitter_rule_with_ties():
    g = torch.Generator().manual_seed(1)
    mass = torch.randint(0, 5, (2, 3, 30), generator=g).float()  # many ties
    got = heavy_hitter_keep(mass, budget=12, window=4)
    for layer in range(2):
        for head in range(3):
            scores = mass[layer, head, :26].tolist()
            assert got[layer, head].tolist() == slow_top(scores, 8) + list(range(26, 30))
    assert heavy_hitter_keep(mass[..., :10], 12, 4).tolist() == [[list(range(10))] * 3] * 2  # within budget: all


@pytest.mark.parametrize("policy", [HeavyHitterPolicy(budget=12, window=4), SnapKVPolicy(budget=12, window=4, kernel=3)])
def test_a_policy_ranks_only_its_committed_slots_of_a_mass_table_with_room_to_spare(policy):
    """The backend's mass table is as long as the cache's capacity; ``keep(slots, mass)`` ranks the
    first ``slots`` entries only (what lies beyond is spare room, or a rolled-back pass's leftovers)."""
    g = torch.Generator().manual_seed(5)
    mass = torch.rand(2, 2, 40, generator=g)
    mass[..., 20:] += 10.0  # spare room holding stale, heavy mass
    rule = heavy_hitter_keep if isinstance(policy, HeavyHitterPolicy) else (
        lambda m, b, w: snapkv_keep(m, b, w, policy.kernel))
    got = policy.keep(20, mass)
    assert torch.equal(got, rule(mass[..., :20].clone(), 12, 4))
    assert got.shape == (2, 2, 12) and int(got.max()) == 19 and got[..., -4:].tolist() == [[list(range(16, 20))] * 2] * 2


def test_snapkv_rule_pools_then_picks():
    g = torch.Generator().manual_seed(2)
    mass = torch.rand(1, 2, 40, generator=g)
    got = snapkv_keep(mass, budget=15, window=5, kernel=5)
    for head in range(2):
        prefix = mass[0, head, :35].tolist()
        # average pooling over 5 with zero padding (count_include_pad, as F.avg_pool1d)
        pooled = [sum(prefix[j] for j in range(i - 2, i + 3) if 0 <= j < 35) / 5 for i in range(35)]
        assert got[0, head].tolist() == slow_top(pooled, 10) + list(range(35, 40))


# The attention the policies rank by --------------------------------------------------------------------


def transformers_attention(seed: int, hidden: int, ids: list[int]) -> list[torch.Tensor]:
    """Per layer, the attention weights [H, n, n] of one pass over ``ids`` (transformers, eager)."""
    model = tiny_hf_model(seed=seed, hidden_size=hidden)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    return [a[0] for a in out.attentions]


def grouped(weights: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[H, ...] -> [H_kv, ...]: the sum over each key/value head's group of query heads."""
    return weights.reshape(n_kv_heads, -1, *weights.shape[1:]).sum(1)


@pytest.mark.parametrize("hidden", SIZES)
def test_h2o_accumulates_the_attention_every_key_has_received(hidden):
    ids = tokens(24, seed=3)
    backend = tiny_llama(seed=5, hidden_size=hidden).with_kv_cache("h2o:budget=64,window=4")
    backend.prefill(ids[:16])  # one pass of 16, then steps: the mass sums every query's weights
    for t in ids[16:]:
        backend.step(torch.tensor([t]))
    reference = transformers_attention(5, hidden, ids)
    for layer, weights in enumerate(reference):
        want = grouped(weights.sum(1), backend.config.num_kv_heads)  # [H_kv, n]
        assert torch.allclose(backend._mass[layer, :, :24], want, atol=1e-4), layer


@pytest.mark.parametrize("hidden", SIZES)
def test_snapkv_ranks_by_the_observation_windows_attention(hidden):
    ids = tokens(40, seed=4)
    policy = SnapKVPolicy(budget=20, window=6, kernel=3)
    backend = tiny_llama(seed=6, hidden_size=hidden).with_kv_cache(policy)
    backend.prefill(ids)
    reference = transformers_attention(6, hidden, ids)
    assert backend.slots == 20 and backend.length == 40
    for layer, weights in enumerate(reference):
        mass = grouped(weights[:, -6:, :].sum(1), backend.config.num_kv_heads)  # the window's rows
        want = snapkv_keep(mass[None], 20, 6, 3)[0]
        got = backend._held[layer, :, :20]
        # near-ties may order differently under float rounding: compare where the scores are apart
        assert (got == want).float().mean() > 0.95, layer
        assert got[:, -6:].tolist() == [list(range(34, 40))] * backend.config.num_kv_heads
    # each kept slot holds the key and value the full cache holds for the token it names
    full = tiny_llama(seed=6, hidden_size=hidden)
    full.prefill(ids)
    index = backend._held[:, :, :20, None].expand(-1, -1, -1, full._k.shape[-1])
    assert torch.allclose(backend._k[:, 0, :, :20], full._k[:, 0].gather(2, index), atol=1e-5)  # (its prefill may differ in rounding)
    assert torch.allclose(backend._v[:, 0, :, :20], full._v[:, 0].gather(2, index), atol=1e-5)
    # a generated token is kept, as every later one (SnapKV compresses the prompt only)
    for _ in range(30):
        backend.step(torch.tensor([1]))
    assert backend.slots == 50


# What each policy holds, step by step ------------------------------------------------------------------


class Recorder:
    """Wraps a backend's compaction: checks each against the rule applied to what was there before."""

    def __init__(self, backend, rule):
        self.backend, self.rule, self.count = backend, rule, 0
        original = backend._compact

        def compact():
            slots = backend.slots
            held, mass = backend._held[..., :slots].clone(), backend._mass[..., :slots].clone()
            k, v = backend._k[:, 0, :, :slots].clone(), backend._v[:, 0, :, :slots].clone()
            original()
            keep = self.rule(slots, mass)
            if keep.dim() == 1:
                keep = keep.expand(*held.shape[:2], -1)
            n = keep.shape[-1]
            assert backend.slots == n
            assert torch.equal(backend._held[..., :n], held.gather(2, keep))
            assert torch.equal(backend._mass[..., :n], mass.gather(2, keep))  # each keeps the attention it received
            index = keep[..., None].expand(-1, -1, -1, v.shape[-1])
            assert torch.equal(backend._v[:, 0, :, :n], v.gather(2, index))  # values move untouched
            if not backend.kv_policy.reassigns_positions:  # (StreamingLLM's keys turn: its test checks them)
                assert torch.equal(backend._k[:, 0, :, :n], k.gather(2, index))  # keys with their values
            self.count += 1

        backend._compact = compact


@pytest.mark.parametrize("hidden", SIZES)
def test_h2o_evicts_by_its_rule_and_stays_within_budget(hidden):
    policy = HeavyHitterPolicy(budget=20, window=5)
    backend = tiny_llama(seed=1, hidden_size=hidden).with_kv_cache(policy)
    recorder = Recorder(backend, lambda slots, mass: heavy_hitter_keep(mass, 20, 5))
    engine = Engine(LoadedModel(backend, CharTokenizer(96), "tiny"))
    engine.generate(tokens(30), max_new_tokens=40, ignore_eos=True)
    # 39 steps after the prompt's pass (the last token is not run), each compacting first
    assert recorder.count == 39 and backend.slots == 21 and backend.length == 69
    # the last window tokens are always there, in the last slots of every head
    assert backend._held[..., backend.slots - 5 : backend.slots].tolist() == [[list(range(64, 69))] * 2] * 2


@pytest.mark.parametrize("hidden", SIZES)
def test_streaming_keeps_sinks_and_window_and_moves_keys_to_their_slots(hidden):
    policy = StreamingPolicy(sink=2, window=12, every=3)
    backend = tiny_llama(seed=2, hidden_size=hidden).with_kv_cache(policy)
    Recorder(backend, lambda slots, mass: streaming_keep(slots, 2, 12))
    backend.prefill(tokens(10))
    for t in tokens(40, seed=9):
        before = backend._k[:, 0].clone(), backend.slots
        backend.step(torch.tensor([t]))
        if backend.slots - 1 < before[1]:  # compacted before this step: check the keys' rotation
            n, moved = backend.slots - 1, before[1] - (backend.slots - 1)
            old = before[0][:, :, streaming_keep(before[1], 2, 12)]
            want = rotate(old, [0, 0] + [-moved] * 12, backend.config.rope_theta)
            assert torch.allclose(backend._k[:, 0, :, :n], want, atol=1e-5)
    assert backend.slots <= 2 + 12 + 3 and backend.length == 50
    held = backend._held[0, 0, : backend.slots].tolist()
    assert held[:2] == [0, 1] and held[2:] == list(range(50 - len(held) + 2, 50))


def rotate(keys: torch.Tensor, by: list[int], theta: float) -> torch.Tensor:
    """Keys [L, H, n, D] (rotary pairs adjacent) rotated by ``by[j]`` positions, in float64."""
    d = keys.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.tensor(by, dtype=torch.float64)[:, None] * inv  # [n, D/2]
    x, y = keys.double()[..., 0::2], keys.double()[..., 1::2]
    out = torch.empty_like(keys, dtype=torch.float64)
    out[..., 0::2] = x * angles.cos() - y * angles.sin()
    out[..., 1::2] = x * angles.sin() + y * angles.cos()
    return out.float()


def test_streaming_runs_past_the_context_window_at_constant_memory():
    backend = tiny_llama(seed=0, hidden_size=64, max_position=64).with_kv_cache("sink:2,window:24,every:4")
    engine = Engine(LoadedModel(backend, CharTokenizer(96), "tiny"))
    out = engine.generate(tokens(100), max_new_tokens=200, ignore_eos=True)  # prompt alone is past the window
    assert len(out.tokens) == 200 and backend.length == 299
    capacity = backend._k.shape[3]
    assert backend.slots <= 2 + 24 + 4 and capacity <= 64
    full = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64, max_position=64), CharTokenizer(96), "tiny"))
    with pytest.raises(PromptTooLong) as err:
        full.generate(tokens(100), max_new_tokens=5)
    assert "\n" not in str(err.value)


def test_a_window_too_large_for_the_context_is_refused():
    with pytest.raises(InvalidParameter, match="more than the model's context"):
        tiny_llama(max_position=64).with_kv_cache("sink:4,window:60")


def test_a_wide_window_counts_prompt_passes_of_at_most_the_prefill_chunk():
    """A window over 256 compacts every window // 8 tokens, more than a prompt pass reads (at most
    PREFILL_CHUNK): its peak counts the prompt's passes as they are, so a window that fits the
    context is taken, decodes past it, and never holds more entries than the peak said."""
    from decodekit.models.batching import PREFILL_CHUNK

    backend = tiny_llama(seed=0, hidden_size=64, max_position=512).with_kv_cache("sink:4,window:420")
    policy = backend.kv_policy
    assert policy.step > PREFILL_CHUNK and policy.peak_slots(1) == 4 + 420 + policy.step - 1 + PREFILL_CHUNK <= 512
    backend.prefill(tokens(600))
    for t in tokens(100, seed=1):
        backend.step(torch.tensor([t]))
    assert backend.length == 700 and backend._peak_slots <= policy.peak_slots(1)


@pytest.mark.parametrize("spec", ["h2o:budget=200,window=8", "snapkv:budget=200,window=8", "sink:4,window:200"])
def test_a_budget_larger_than_the_sequence_changes_nothing(spec):
    prompt = tokens(40)
    full = Engine(LoadedModel(tiny_llama(seed=3, hidden_size=64), CharTokenizer(96), "tiny"))
    policy = Engine(LoadedModel(tiny_llama(seed=3, hidden_size=64).with_kv_cache(spec), CharTokenizer(96), "tiny"))
    want = full.generate(prompt, max_new_tokens=30, ignore_eos=True).tokens
    assert policy.generate(prompt, max_new_tokens=30, ignore_eos=True).tokens == want


def test_rollback_within_the_window_works_and_beyond_it_is_refused():
    backend = tiny_llama(seed=0, hidden_size=64).with_kv_cache("sink:2,window:8,every:2")
    backend.prefill(tokens(30))
    backend.step(torch.tensor([5]))  # compacts first
    length = backend.length
    held = backend._held[0, 0, : backend.slots].tolist()
    backend.append(torch.tensor([[1, 2, 3]]))  # read 2 at a time: compacts between them
    backend.truncate(length)
    now = backend._held[0, 0, : backend.slots].tolist()
    assert backend.length == length and now[:2] == [0, 1] and now[2:] == held[-len(now) + 2 :]
    with pytest.raises(ValueError, match="evicted"):
        backend.truncate(length - 9)


def test_an_h2o_cache_at_its_budget_has_evicted_nothing_and_rolls_back_anywhere():
    """H2O evicts before a pass that starts with more than ``budget`` entries; one that starts with
    exactly ``budget`` keeps every entry, so every earlier length is still there to roll back to."""
    backend = tiny_llama(seed=0, hidden_size=64).with_kv_cache("h2o:budget=20,window=4")
    backend.prefill(tokens(20))
    backend.step(torch.tensor([5]))  # starts with 20 entries: nothing to evict
    assert (backend.length, backend.slots) == (21, 21)
    backend.truncate(10)
    assert backend._held[0, 0, : backend.slots].tolist() == list(range(10))
    backend.prefill(tokens(21))
    backend.step(torch.tensor([5]))  # starts with 21: evicts down to 20, the window's 4 held as they were
    assert backend.slots == 21
    with pytest.raises(ValueError, match="evicted"):
        backend.truncate(10)


def test_policies_need_the_native_backend_and_one_sequence():
    backend = tiny_llama(seed=0).with_kv_cache("sink:2,window:8")
    with pytest.raises(InvalidParameter, match="one sequence"):
        backend.prefill(tokens(5), batch_size=3)
    engine = Engine(LoadedModel(backend, CharTokenizer(96), "tiny"))
    with pytest.raises(InvalidParameter, match="one sequence"):
        engine.generate("abc", method="beam", max_new_tokens=4, chat=False)


# kvdraft: lossless self-speculation from a compressed cache ----------------------------------------------


@pytest.mark.parametrize("hidden", SIZES)
@pytest.mark.parametrize("cache", ["sink:2,window:8", "sink:1,window:6,every:1", "snapkv:budget=24,window=4",
                                   "h2o:budget=24,window=4"])
def test_kvdraft_greedy_is_plain_greedy(hidden, cache):
    engine = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=hidden, scale=3.0), CharTokenizer(96), "tiny"))
    for seed in range(3):
        prompt = tokens(40, seed=seed)
        want = engine.generate(prompt, max_new_tokens=40, ignore_eos=True).tokens
        for budget in (2, 5):
            got = engine.generate(prompt, method="kvdraft", draft_cache=cache, max_new_tokens=40, ignore_eos=True,
                                  budget=budget)
            assert got.tokens == want, (cache, seed, budget)
            assert got.stats.extra["verifications"] > 0


def test_adopt_refuses_token_ids_that_are_not_the_sources():
    """adopt() copies the source's committed entries as those of ``token_ids``: ids of another
    length than the source holds would leave the cache's length and its entries apart."""
    target = tiny_llama(seed=2, hidden_size=64)
    prompt = tokens(30)
    target.prefill(prompt)
    draft = target.with_kv_cache("sink:2,window:8,every:1")
    with pytest.raises(ValueError, match="holding one sequence"):
        draft.adopt(target, prompt[:-1])
    with pytest.raises(ValueError, match="holding one sequence"):
        draft.adopt(target, prompt + [1])


def test_kvdraft_draft_cache_is_the_targets_compressed():
    """The draft's cache starts as the target's prompt entries under the policy, without a second
    read: its first logits equal those of a cache that read the prompt under the policy itself
    when the policy keeps everything, and its entries are the target's where it does not."""
    target = tiny_llama(seed=2, hidden_size=64)
    prompt = tokens(30)
    target.prefill(prompt)
    draft = target.with_kv_cache("sink:2,window:8,every:1")
    draft.adopt(target, prompt)
    assert (draft.length, draft.slots) == (30, 10)
    kept = streaming_keep(30, 2, 8)
    assert torch.equal(draft._v[:, 0, :, :10], target._v[:, 0, :, kept])
    assert draft._held[0, 0, :10].tolist() == kept.tolist()
    with pytest.raises(ValueError):
        draft.adopt(draft, prompt)  # the source must be a full cache
    # the window's tokens are held as they were: rollback reaches back that far, and no further
    with pytest.raises(ValueError, match="evicted"):
        draft.truncate(30 - 8 - 1)
    draft.truncate(30 - 8)
    assert (draft.length, draft.slots) == (22, 2)


def kvdraft_chain(prompt: list[int], root: int, draft_cache: str, depth: int, **config):
    """A greedy target (tiny, seed 0; ``config`` its own, e.g. ``max_position``) after ``prompt`` and
    ``root``, the chain of ``depth`` tokens that kvdraft over ``draft_cache`` drafts from there, used
    without the loop (``begin`` only), and the drafter."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.samplers import Sampler
    from decodekit.speculative.drafters.kvdraft import CompressedCacheDrafter

    target = tiny_llama(seed=0, hidden_size=64, scale=3.0, **config)
    state = DecodeState(target, Sampler(greedy=True), prompt, GenerationStats())
    state.prefill()
    state.commit([root])
    drafter = CompressedCacheDrafter(draft_cache=draft_cache, confidence=0.0)
    drafter.begin(state)
    return target, drafter.draft(state, depth), drafter


def test_kvdraft_drafts_attending_to_the_first_sink_and_the_last_window_entries():
    """MagicDec's StreamingLLM draft: each draft pass of ``sink:S,window:W`` attends to the first S and
    the last W entries of the target's own cache; its greedy chain is the one such passes give."""
    prompt, root = tokens(40, seed=4), 7
    target, tree, drafter = kvdraft_chain(prompt, root, "sink:2,window:8", 4)
    assert target.length == len(prompt)  # the draft's entries rolled back
    reference = tiny_llama(seed=0, hidden_size=64, scale=3.0)
    reference.prefill(prompt)
    token, chain = root, []
    for _ in range(4):
        token = int(reference.append_windowed(torch.tensor([[token]]), 2, 8).logits[0, -1].argmax())
        chain.append(token)
    assert tree.tokens == chain and tree.parents == [-1, 0, 1, 2]
    assert drafter.last_steps == 4  # a draft pass per token: what the controller prices the chain by
    other = tiny_llama(seed=0, hidden_size=64, scale=3.0)  # the same chain with sink and window swapped differs
    other.prefill(prompt)
    token, swapped = root, []
    for _ in range(4):
        token = int(other.append_windowed(torch.tensor([[token]]), 8, 2).logits[0, -1].argmax())
        swapped.append(token)
    assert swapped != chain


def test_kvdraft_used_without_the_loop_builds_its_draft_cache_in_begin():
    """A drafter used without the loop (no ``check`` before prefill) checks the target in ``begin``
    (the drafter contract): a compressed draft cache is made there, from the target's prompt entries,
    and the chain is the greedy chain of that cache; the target's cache is left as it was."""
    prompt, root = tokens(30, seed=2), 7
    target, tree, _ = kvdraft_chain(prompt, root, "int8", 3)
    assert target.length == len(prompt)
    reference = tiny_llama(seed=0, hidden_size=64, scale=3.0)
    reference.prefill(prompt)
    draft = reference.with_kv_cache("int8")
    draft.adopt(reference, prompt)
    token, chain = root, []
    for _ in range(3):
        token = int(draft.append(torch.tensor([[token]])).logits[0, -1].argmax())
        chain.append(token)
    assert tree.tokens == chain and tree.parents == [-1, 0, 1]


@pytest.mark.parametrize("draft_cache", ["sink:2,window:8", "int8"])
def test_kvdraft_near_the_end_of_the_context_drafts_only_what_the_context_holds(draft_cache):
    """Asked for a chain longer than the context has room for, kvdraft drafts what fits (the target
    then verifies root and chain within its context) and, with no room left, makes no draft pass."""
    for length, fits in ((91, 4), (93, 2), (95, 0)):  # a context of 96: prompt, root, then the chain
        target, tree, drafter = kvdraft_chain(tokens(length, seed=4), 7, draft_cache, 4, max_position=96)
        assert len(tree.tokens) == fits and drafter.last_steps == fits, (length, draft_cache)
        assert target.length == length  # the target's cache left as it was


@pytest.mark.parametrize("hidden", SIZES)
def test_h2o_reads_a_prompt_64_tokens_a_pass_evicting_between_them(monkeypatch, hidden):
    """The choice H2O's docstring states: a long prompt in the kernels' passes of 64 tokens, the cache
    evicted down to its budget before each pass that finds it over (in either numerics, alone and
    served: where it evicts must not depend on what else runs; nor on whether the kernels take the
    passes: head size 8 runs torch's, which would take the prompt whole)."""
    from decodekit.models.native import NativeLlama

    cache = tiny_llama(seed=0, hidden_size=hidden, max_position=1024).with_kv_cache("h2o:budget=40,window=8")
    passes, forward = [], NativeLlama._forward
    monkeypatch.setattr(NativeLlama, "_forward", lambda self, tokens, *a, **k: passes.append((tokens.shape[1], self._slots))
                        or forward(self, tokens, *a, **k))
    cache.prefill(tokens(160))
    assert passes == [(64, 0), (64, 40), (32, 40)]


def test_an_adopted_h2o_cache_keeps_the_heavy_hitters_of_the_prompt():
    """H2O's scores count the prompt's own queries: a cache adopted from the target keeps what one
    that read the prompt itself keeps (it kept the earliest slots, every score tied at zero)."""
    prompt = tokens(60, seed=3)
    target = tiny_llama(seed=5, hidden_size=64)
    target.prefill(prompt)
    adopted = target.with_kv_cache("h2o:budget=20,window=4")
    adopted.adopt(target, prompt)
    read = tiny_llama(seed=5, hidden_size=64).with_kv_cache("h2o:budget=20,window=4")
    read.prefill(prompt)
    for cache in (adopted, read):
        cache.step(torch.tensor([7]))
    assert torch.equal(adopted._held[..., : adopted.slots], read._held[..., : read.slots])
    kept = adopted._held[..., : adopted.slots].reshape(-1, adopted.slots).sort(dim=-1).values
    assert not torch.equal(kept[:, :16], torch.arange(16).expand_as(kept[:, :16]))  # heavy hitters, not the first slots


def test_kvdraft_says_why_a_model_cannot_hold_its_draft_cache():
    engine = Engine(LoadedModel(tiny_llama(seed=0, dtype=torch.bfloat16), CharTokenizer(96), "tiny"))
    with pytest.raises(InvalidParameter, match=r"^draft_cache int8: .*float32") as refused:
        engine.generate("abc abc abc abc", method="kvdraft", draft_cache="int8", max_new_tokens=5, chat=False)
    assert refused.value.param == "draft_cache"


def test_kvdraft_refuses_a_cache_that_keeps_everything_and_other_backends():
    engine = Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))
    with pytest.raises(InvalidParameter, match="compressed"):
        engine.generate("abc", method="kvdraft", draft_cache="full", max_new_tokens=3, chat=False)
    with pytest.raises(InvalidParameter, match="kv cache"):
        engine.generate("abc", method="kvdraft", draft_cache="sink:1", max_new_tokens=3, chat=False)
    small = Engine(LoadedModel(tiny_llama(seed=0, max_position=96), CharTokenizer(96), "tiny"))
    with pytest.raises(InvalidParameter, match="more than the model's context of 96"):  # as --kv-cache refuses it
        small.generate("abc", method="kvdraft", draft_cache="sink:4,window:200", max_new_tokens=3, chat=False)
    with pytest.raises(InvalidParameter, match="unknown kv cache 'int4:'"):
        parse_kv_cache("int4:")
    with pytest.raises(InvalidParameter, match="expected sink:N first"):
        parse_kv_cache("sink:\u0663,window:8")  # a digit of another script


def test_kvdraft_under_an_int8_model_cache_drafts_only_through_a_window():
    """Under the model's int8 cache a draft cache is a window over it (sink:S,window:W); a separate
    compressed clone (snapkv, int8) is refused in one line naming draft_cache."""
    engine = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64).with_kv_cache("int8"), CharTokenizer(96), "tiny"))
    for spec in ("snapkv:budget=24,window=4", "int8"):
        with pytest.raises(InvalidParameter, match=f"draft_cache must be sink:S,window:W, got {spec}") as refused:
            engine.generate("abc abc abc", method="kvdraft", draft_cache=spec, max_new_tokens=3, chat=False)
        assert refused.value.param == "draft_cache"


def test_kvdraft_takes_a_draft_cache_that_needs_exactly_the_models_context():
    """Refused only for *more* entries than the context, as --kv-cache is: sink:4,window:75 peaks at
    4 + 75 + 9 - 1 + 9 = 96 entries (its compaction step is 9), a context of 96 holds it."""
    assert parse_kv_cache("sink:4,window:75").peak_slots(1) == 96
    small = Engine(LoadedModel(tiny_llama(seed=0, max_position=96), CharTokenizer(96), "tiny"))
    plain = small.generate("abc abc abc", max_new_tokens=5, chat=False).tokens
    got = small.generate("abc abc abc", method="kvdraft", draft_cache="sink:4,window:75", max_new_tokens=5, chat=False)
    assert got.tokens == plain


def test_real_model_streaming_and_kvdraft(real_model):
    """The embedded model: a streaming cache keeps its memory as the text grows, and kvdraft from
    a small window is token-identical to greedy."""
    engine = Engine(real_model)
    prompt = "Write a long story about a lighthouse keeper. " * 20  # 200 tokens: past both windows
    want = engine.generate(prompt, max_new_tokens=24)
    got = engine.generate(prompt, method="kvdraft", draft_cache="sink:4,window:64", max_new_tokens=24, budget=4)
    assert got.tokens == want.tokens and got.stats.extra["verifications"] > 0
    streaming = Engine(LoadedModel(real_model.backend.with_kv_cache("sink:4,window:128"), real_model.tokenizer, "s"))
    out = streaming.generate(prompt, max_new_tokens=40, ignore_eos=True)
    assert len(out.tokens) == 40 and streaming.model.backend.slots <= 4 + 128 + 16
    assert not math.isnan(float(streaming.model.backend._k[0, 0, 0, 0, 0]))


# The int8 cache ------------------------------------------------------------------------------------------


def test_int8_cache_rows_are_the_quantised_float_rows_and_take_a_quarter_of_the_memory():
    from decodekit.models.kernels import dequantise_int8_rows, quantise_int8_rows

    full = tiny_llama(seed=0, hidden_size=64)
    int8 = full.with_kv_cache("int8")
    ids = torch.tensor([tokens(100)])
    full.append(ids[:, :64]), full.append(ids[:, 64:])  # the same passes as the int8 cache's reads
    int8.append(ids)
    # layer 0's keys and values come from the same inputs: the C quantiser is torch's, bit for bit
    for mine, theirs in ((int8._k, full._k), (int8._v, full._v)):
        assert torch.equal(mine[0, 0, :, :100].view(torch.int32), quantise_int8_rows(theirs[0, 0, :, :100]).view(torch.int32))
        error = (dequantise_int8_rows(mine[0, 0, :, :100]) - theirs[0, 0, :, :100]).abs()
        step = theirs[0, 0, :, :100].abs().amax(-1, keepdim=True) / 127
        assert bool((error <= step / 2 + 1e-6).all())  # within half a step of its row
    assert int8.cache_bytes() / full.cache_bytes() == (16 + 4) / (4 * 16)  # head size 16: int8 values + a scale


def test_a_row_too_small_to_invert_its_scale_is_stored_as_zeros_by_the_kernel_as_in_python():
    """A key or value row below ~3.7e-37 has an infinite 1 / scale: rope_store_q8 stored -128 for
    every value (a sign flipped), quantise_int8_rows the row itself; both store zeros now."""
    from decodekit.models.kernels import dequantise_int8_rows, int8_cache_kernels, quantise_int8_rows

    d = 16
    value = torch.full((d,), 1e-38)
    value[1::2] = 0.0
    qkv = torch.zeros(1, 3 * d)
    qkv[0, 2 * d :] = value
    k_cache, v_cache = torch.zeros(1, 4, d // 4 + 1), torch.zeros(1, 4, d // 4 + 1)
    int8_cache_kernels(d).rope_store(qkv, torch.tensor([1.0, 0.0] * (d // 2)).repeat(4, 1), torch.tensor([0]),
                                     k_cache, v_cache, 0, 1)
    assert torch.equal(v_cache[0, :1].view(torch.int32), quantise_int8_rows(value[None]).view(torch.int32))
    assert torch.equal(dequantise_int8_rows(v_cache[0, :1])[0], torch.zeros(d))


@pytest.mark.parametrize("head_dim", [32, 64, 128])  # one query a job; three heads of a group a job; two
def test_int8_attention_is_float_attention_on_the_dequantised_rows(head_dim):
    from decodekit.models.kernels import dequantise_int8_rows, int8_cache_kernels, layout_independent_attention, quantise_int8_rows

    kernels, reference = int8_cache_kernels(head_dim), layout_independent_attention(torch.float32, head_dim)
    if kernels is None or reference is None:
        pytest.skip("kernels unavailable")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 6, head_dim, generator=g), torch.randn(2, 70, head_dim, generator=g),
               torch.randn(2, 70, head_dim, generator=g))
    visible = torch.rand(5, 70, generator=g) < 0.8
    pk, pv, scale = quantise_int8_rows(k), quantise_int8_rows(v), head_dim**-0.5
    got = kernels.attention(q, pk, pv, visible, scale)
    same_values = reference(q, dequantise_int8_rows(pk), dequantise_int8_rows(pv), visible, scale)
    assert torch.allclose(got, same_values, atol=1e-5)  # only the rounding of the products differs
    exact = reference(q, k, v, visible, scale)
    assert (got - exact).abs().max() < 0.05 and not torch.equal(got, exact)  # the quantisation's error, no more
    for row in range(5):  # a row alone (other jobs, other thread split) gives the same bits as in the pass
        assert torch.equal(kernels.attention(q[row : row + 1], pk, pv, visible[row : row + 1], scale), got[row : row + 1])


def test_int8_kernels_refuse_value_caches_laid_out_unlike_the_keys():
    """Both int8 kernels walk the key and value caches with the keys' strides: a value cache of
    another layout (a slice of a wider cache, a non-contiguous copy) is refused, not misread."""
    from decodekit.models.kernels import int8_cache_kernels, quantise_int8_rows

    d = 16
    kernels = int8_cache_kernels(d)
    if kernels is None:
        pytest.skip("kernels unavailable")
    g = torch.Generator().manual_seed(5)
    pk = quantise_int8_rows(torch.randn(2, 8, d, generator=g))
    wide = quantise_int8_rows(torch.randn(2, 16, d, generator=g))[:, :8]  # 16 rows a head apart, not 8
    q = torch.randn(1, 2, d, generator=g)
    with pytest.raises(ValueError, match="int8 attention"):
        kernels.attention(q, pk, wide, None, d**-0.5)
    qkv = torch.randn(1, 3 * d, generator=g)
    freqs = torch.tensor([1.0, 0.0] * (d // 2)).repeat(4, 1)
    k_cache = torch.zeros(1, 4, d // 4 + 1)
    v_cache = torch.zeros(1, 8, d // 4 + 1)[:, ::2]  # [1, 4, row], every other slot: not contiguous
    with pytest.raises(ValueError, match="int8 rope_store"):
        kernels.rope_store(qkv, freqs, torch.tensor([0]), k_cache, v_cache, 0, 1)


def test_int8_cache_speculation_is_lossless_relative_to_int8_greedy():
    engine = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64, scale=3.0).with_kv_cache("int8"), CharTokenizer(96), "tiny"))
    prompt = tokens(80)
    want = engine.generate(prompt, max_new_tokens=40, ignore_eos=True).tokens
    for method in ("pld", "suffix"):
        assert engine.generate(prompt, method=method, max_new_tokens=40, ignore_eos=True, budget=4).tokens == want
    windowed = engine.generate(prompt, method="kvdraft", draft_cache="sink:2,window:8", max_new_tokens=40, ignore_eos=True)
    assert windowed.tokens == want and windowed.stats.extra["verifications"] > 0
    with pytest.raises(InvalidParameter, match=r"under the model.s int8 cache .* draft_cache must be sink:S,window:W, got snapkv"):
        engine.generate(prompt, method="kvdraft", draft_cache="snapkv:budget=40,window=4", max_new_tokens=4)


def test_kvdraft_from_an_int8_draft_cache_is_plain_greedy():
    engine = Engine(LoadedModel(tiny_llama(seed=1, hidden_size=64, scale=3.0), CharTokenizer(96), "tiny"))
    prompt = tokens(70)
    want = engine.generate(prompt, max_new_tokens=30, ignore_eos=True).tokens
    got = engine.generate(prompt, method="kvdraft", draft_cache="int8", max_new_tokens=30, ignore_eos=True, budget=4)
    assert got.tokens == want and got.stats.extra["accepted"] > 0


@pytest.mark.parametrize("method, options", [("hierarchy", {"order": "kvdraft,pld"}), ("auto", {"arms": "kvdraft,pld"})])
def test_kvdraft_inside_hierarchy_and_auto(method, options):
    engine = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64, scale=3.0), CharTokenizer(96), "tiny"))
    prompt = tokens(60, seed=5)
    want = engine.generate(prompt, max_new_tokens=30, ignore_eos=True).tokens
    got = engine.generate(prompt, method=method, max_new_tokens=30, ignore_eos=True, budget=4, **options)
    assert got.tokens == want
    assert got.stats.extra["accepted_by_source"].get("kvdraft", 0) > 0


def test_a_windowed_caches_bound_is_not_called_the_models_context():
    """A sink:S,window:W cache runs past the model's context up to a bound of its own: an answer
    longer than that is refused naming that bound, not a "context" the model does not have."""
    from decodekit.engine import check_fits
    from decodekit.errors import PromptTooLong

    backend = tiny_llama(seed=0, hidden_size=64, max_position=64).with_kv_cache("sink:2,window:16")
    check_fits(backend, 10, 10_000)  # past the model's 64 tokens: the window makes room
    with pytest.raises(PromptTooLong, match=rf"^prompt of 10 tokens \+ {2**40} new tokens exceeds the {2**40} tokens a "
                                            "sequence may have under its windowed cache$"):
        check_fits(backend, 10, 2**40)
    with pytest.raises(PromptTooLong, match="exceeds the model's context of 64$"):
        check_fits(tiny_llama(seed=0, hidden_size=64, max_position=64), 10, 60)


@pytest.mark.parametrize("spec", ["h2o:budget=16,window=4", "snapkv:budget=16,window=4"])
def test_policies_that_keep_positions_stop_at_the_context_window(spec):
    """They evict, so their cache never fills, but positions past the window have no rotary angle:
    refused in one line, not read out of bounds."""
    backend = tiny_llama(seed=0, hidden_size=64, max_position=64).with_kv_cache(spec)
    with pytest.raises(ValueError, match="exceeds the model's context of 64; a sink:S,window:W cache runs past it"):
        backend.prefill(tokens(100))
    backend.prefill(tokens(60))
    with pytest.raises(ValueError, match="context of 64"):
        for t in tokens(10):
            backend.step(torch.tensor([t]))


# The int4 cache (KIVI) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_codes_are_within_half_a_step_per_channel_group_and_per_token(bits):
    from decodekit.models.kivi import (
        dequantise_keys, dequantise_values, pack_codes, quantise_keys, quantise_values, unpack_codes,
    )

    levels = (1 << bits) - 1
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, levels + 1, (3, 5, 32), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits), codes)
    packed, n = pack_codes(codes, bits), 2 * bits  # a chunk of 16 channels in n bytes
    # byte b of a chunk: channels b, b + n, b + 2n, ... from its lowest bits up
    for chunk, b in ((0, 1), (1, n - 1)):
        want = sum(int(codes[0, 0, 16 * chunk + b + n * k]) << (bits * k) for k in range(8 // bits))
        assert int(packed[0, 0, n * chunk + b]) == want
    x = torch.randn(2, 24, 32, generator=g) * torch.linspace(0.1, 8, 32)  # channels of different spans
    x[0, :8, 3] = 1.5  # a channel constant over a group: exact
    k_codes, k_params = quantise_keys(x, 8, bits)
    assert k_codes.shape == (2, 24, 32 * bits // 8) and k_params.shape == (2, 3, 2, 32)
    keys = dequantise_keys(k_codes, k_params, 8, bits)
    groups = x.view(2, 3, 8, 32)
    step = (groups.amax(2) - groups.amin(2)) / levels  # per channel and group
    assert bool(((keys - x).abs().view(2, 3, 8, 32) <= step[:, :, None] / 2 + 1e-6).all())
    assert torch.equal(keys[0, :8, 3], x[0, :8, 3])
    v_codes, v_params = quantise_values(x, bits)
    values = dequantise_values(v_codes, v_params, bits)
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / levels  # per token
    assert bool(((values - x).abs() <= step / 2 + 1e-6).all())
    # per channel, not per token: a key channel's error is bounded by its own span, however large another's is
    assert (keys - x)[..., 0].abs().max() < 0.1 / levels * 4
    # a span of 0 has no step: every code is 0 (the code is the minimum), never 1 / 0's infinity or a NaN cast
    from decodekit.models.kivi import _codes
    assert _codes(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([1.0]), bits).tolist() == [0]


def test_a_kivi_store_refuses_head_sizes_it_cannot_pack_and_part_groups():
    """Codes are packed 16 channels a chunk, and keys quantised over whole groups of tokens: a head size
    that is not a multiple of 16, or an append of part of a group, is refused with a ValueError that
    says so, and the store is left as it was."""
    from decodekit.models.kivi import KiviStore

    for head_dim in (8, 24, 40):
        with pytest.raises(ValueError, match="multiple of 16"):
            KiviStore(1, 2, head_dim, 8, 4)
    g = torch.Generator().manual_seed(6)
    store = KiviStore(1, 2, 32, 8, 2)
    store.append(torch.randn(1, 2, 8, 32, generator=g), torch.randn(1, 2, 8, 32, generator=g))
    before = store.k_codes[:, :, :8].clone(), store.k_params[:, :, :1].clone()
    for n in (4, 12, 1):
        with pytest.raises(ValueError, match="whole groups of 8 tokens"):
            store.append(torch.randn(1, 2, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g))
        assert store.tokens == 8
    assert torch.equal(store.k_codes[:, :, :8], before[0]) and torch.equal(store.k_params[:, :, :1], before[1])
    store.append(torch.randn(1, 2, 16, 32, generator=g), torch.randn(1, 2, 16, 32, generator=g))
    assert store.tokens == 24


def test_a_kivi_store_appended_a_group_at_a_time_grows_by_doubling():
    """Decoding appends one group at a time: the store's capacity at least doubles each time it grows
    (a copy of every code so far at each group would make a long output's appends quadratic)."""
    from decodekit.models.kivi import KiviStore

    g = torch.Generator().manual_seed(7)
    store, capacities = KiviStore(1, 2, 32, 8, 4), []
    for _ in range(40):
        store.append(torch.randn(1, 2, 8, 32, generator=g), torch.randn(1, 2, 8, 32, generator=g))
        if store.capacity not in capacities:
            capacities.append(store.capacity)
    assert store.tokens == 320 <= store.capacity
    assert all(after >= 2 * before for before, after in zip(capacities, capacities[1:])), capacities


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("head_dim, heads", [(32, 6), (64, 6), (64, 8), (128, 6)])
@pytest.mark.parametrize("earlier", [0, 256])  # tokens before: every row's keys in one segment of 256, or in two
def test_kivi_attention_is_float_attention_on_the_dequantised_entries(head_dim, heads, bits, earlier):
    """Head sizes 64 and 128 take the kernels that rebuild each entry once for a group's heads
    (3 or 4 a job, 2 at 128) and unpack four chunks at once, 32 the general one chunk by chunk.
    A row that sees more than 256 keys has its values summed a segment at a time, as the float
    kernel's (the reference) are."""
    from decodekit.models.kernels import kivi_attention, layout_independent_attention
    from decodekit.models.kivi import KiviStore, KiviView, dequantise_keys, dequantise_values

    D = head_dim
    kernel, reference = kivi_attention(D), layout_independent_attention(torch.float32, D)
    if kernel is None or reference is None:
        pytest.skip("kernels unavailable")
    g = torch.Generator().manual_seed(0)
    n, group, base = 90 + earlier, 8, 40 + earlier  # positions 0..n-1; 0..63 (+ earlier) quantised, the buffer from base on
    k, v = torch.randn(1, 2, n, D, generator=g), torch.randn(1, 2, n, D, generator=g)
    store = KiviStore(1, 2, D, group, bits)
    for at in range(0, 64 + earlier, 32):  # grows
        store.append(k[:, :, at : at + 32], v[:, :, at : at + 32])
    q = torch.randn(4, heads, D, generator=g)
    qend = torch.tensor([40, 48, 64, 56]) + earlier
    visible = torch.rand(4, n - base, generator=g) < 0.7
    buffer_k, buffer_v = k[0, :, base:].contiguous(), v[0, :, base:].contiguous()
    got = kernel(q, KiviView(store, base, qend), 0, buffer_k, buffer_v, n - base, visible, D**-0.5)
    keys_q = dequantise_keys(store.k_codes[0], store.k_params[0], group, bits)
    values_q = dequantise_values(store.v_codes[0], store.v_params[0], bits)
    exact_rows = []
    for row in range(4):
        end = int(qend[row])
        keys, values = torch.cat([keys_q[:, :end], k[0, :, end:]], 1), torch.cat([values_q[:, :end], v[0, :, end:]], 1)
        seen = torch.cat([torch.ones(end, dtype=torch.bool), visible[row, end - base :]])
        want = reference(q[row : row + 1], keys, values, seen[None], D**-0.5)
        assert torch.allclose(got[row], want[0], atol=1e-5), row  # the codes read as dequantised, no more
        seen = torch.cat([torch.ones(base, dtype=torch.bool), visible[row]])
        exact_rows.append(reference(q[row : row + 1], k[0], v[0], seen[None], D**-0.5)[0])
    error = (got - torch.stack(exact_rows)).abs()
    assert error[0].max() < (0.5 if bits == 4 else 1.5) and error[2].max() > 0  # quantisation's error, where read
    alone = torch.cat([kernel(q[row : row + 1], KiviView(store, base, qend[row : row + 1]), 0, buffer_k, buffer_v,
                              n - base, visible[row : row + 1], D**-0.5) for row in range(4)])
    assert torch.equal(alone, got)  # a row's result does not depend on the pass's other rows


def test_kivi_attention_refuses_quantised_ends_outside_the_codes_written():
    """A row's quantised end lies between the residual's base and the tokens quantised so far: an
    end past those tokens (codes never written, in the store's spare room) or below the base (keys
    in neither part) is refused, not read; so are fewer ends than rows."""
    from decodekit.models.kernels import kivi_attention
    from decodekit.models.kivi import KiviStore, KiviView

    kernel = kivi_attention(32)
    if kernel is None:
        pytest.skip("kernels unavailable")
    g = torch.Generator().manual_seed(3)
    store = KiviStore(1, 2, 32, 8, 4)
    store.append(torch.randn(1, 2, 8, 32, generator=g), torch.randn(1, 2, 8, 32, generator=g))
    assert store.tokens == 8 and store.capacity >= 16
    q, k, v = torch.randn(1, 6, 32, generator=g), torch.randn(2, 16, 32, generator=g), torch.randn(2, 16, 32, generator=g)
    assert kernel(q, KiviView(store, 8, torch.tensor([8])), 0, k, v, 16, None, 32**-0.5).isfinite().all()
    for base, qend in ((8, 16), (8, 4)):
        with pytest.raises(ValueError, match="quantised end"):
            kernel(q, KiviView(store, base, torch.tensor([qend])), 0, k, v, 16, None, 32**-0.5)
    # every row has its own end: fewer ends than rows were read past their tensor (the ends here a
    # slice of three, so that a kernel reading the third reads a valid end, not memory past the tensor)
    q, visible = torch.randn(3, 6, 32, generator=g), torch.ones(3, 16, dtype=torch.bool)
    assert kernel(q, KiviView(store, 8, torch.tensor([8, 8, 8])), 0, k, v, 16, visible, 32**-0.5).isfinite().all()
    for qend in (torch.tensor([8, 8, 8], dtype=torch.int32)[:2], torch.tensor([8, 8, 8], dtype=torch.int32)[:1]):
        with pytest.raises(ValueError, match="every row needs a quantised end"):
            kernel(q, KiviView(store, 8, qend), 0, k, v, 16, visible, 32**-0.5)


def test_kivi_attention_refuses_residuals_and_queries_it_cannot_read():
    """The kernel walks the key and value residuals with one layout, head_dim values a row, and
    reads head_dim values a query: value residuals shaped unlike the keys', or queries of another
    head size, are refused, not read past their ends."""
    from decodekit.models.kernels import kivi_attention
    from decodekit.models.kivi import KiviStore, KiviView

    kernel = kivi_attention(32)
    if kernel is None:
        pytest.skip("kernels unavailable")
    g = torch.Generator().manual_seed(4)
    store = KiviStore(1, 2, 32, 8, 4)
    store.append(torch.randn(1, 2, 8, 32, generator=g), torch.randn(1, 2, 8, 32, generator=g))
    q, k = torch.randn(1, 6, 32, generator=g), torch.randn(2, 16, 32, generator=g)
    view = KiviView(store, 8, torch.tensor([8]))
    with pytest.raises(ValueError, match="kivi attention: needs head_dim 32"):
        kernel(q, view, 0, k, torch.randn(2, 4, 32, generator=g), 4, None, 32**-0.5)  # fewer value rows
    with pytest.raises(ValueError, match="kivi attention: needs head_dim 32"):
        kernel(torch.randn(1, 6, 16, generator=g), view, 0, k, k.clone(), 16, None, 32**-0.5)


@pytest.mark.parametrize("group, residual", [(8, 64), (32, 128), (1, 64)])
def test_kivi_quantised_end_leaves_each_query_residual_to_residual_plus_group_minus_one_float_tokens(group, residual):
    policy = KiviPolicy(group=group, residual=residual)
    positions = torch.arange(400)
    got = policy.quantised_end(positions).tolist()
    for p in positions.tolist():
        end = 0  # the last group boundary that still leaves the query (itself included) residual float tokens
        while end + group <= p + 1 - residual:
            end += group
        assert got[p] == end, p
        if p + 1 >= residual:
            assert residual <= p + 1 - end <= residual + group - 1, p
    if (group, residual) == (8, 64):  # by hand: position 71 is the first to read a group (0..7) from codes
        assert got[70] == 0 and got[71] == 8 and got[78] == 8 and got[79] == 16

@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_cache_quantises_the_float_entries_a_group_at_a_time_and_keeps_the_residual_bounded(bits):
    from decodekit.models.kivi import quantise_keys, quantise_values

    full = tiny_llama(seed=0, hidden_size=64)
    int4 = full.with_kv_cache(f"int{bits}:group=8,residual=64")
    ids = torch.tensor([tokens(300)])
    for part in ids.split(64, dim=1):  # the int4 cache reads 64 tokens a pass
        full.append(part)
    most = 0
    for part in ids.split(50, dim=1):
        int4.append(part)
        most = max(most, int4.slots)
        # the pass's last query read the positions below quantised_end(its position) from codes
        assert int4._kivi.tokens == int(int4.kv_policy.quantised_end(torch.tensor(int4.length - 1)))
    store = int4._kivi
    assert store.tokens == 232 and int4.length == 300 and int4._base <= 300 - 64 - 8
    # layer 0's entries come from the embeddings alone (later layers' from attention over codes): the
    # codes of the float entries the full cache holds, and its float rows from the buffer's base on
    codes, params = quantise_keys(full._k[0, 0, :, :232], 8, bits)
    assert torch.equal(store.k_codes[0, :, :232], codes) and torch.equal(store.k_params[0, :, :29], params)
    codes, params = quantise_values(full._v[0, 0, :, :232], bits)
    assert torch.equal(store.v_codes[0, :, :232], codes) and torch.equal(store.v_params[0, :, :232], params)
    assert torch.equal(int4._k[0, 0, :, : int4.slots], full._k[0, 0, :, int4._base : 300])
    assert torch.equal(int4._v[0, 0, :, : int4.slots], full._v[0, 0, :, int4._base : 300])
    assert most <= 64 + 8 + 2 * 64  # the residual, a group, the pass, and what waits to be dropped
    assert int4._k.shape[3] == 0 + 64 + 2 * 8 + 64  # allocated for no more (rollback reach 0 at residual 64)
    # per quantised token and head (size 16): 2 x 2 x bits bytes of codes, a value's scale and minimum,
    # and an eighth of its group's scales and minima; per residual slot: float32 key and value
    c = full.config
    per_token = 4 * bits + 8 + 2 * 16 * 4 // 8
    assert int4.cache_bytes() == c.num_layers * c.num_kv_heads * (232 * per_token + int4.slots * 2 * 16 * 4)


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_logits_do_not_depend_on_how_the_sequence_is_cut(bits):
    backend = tiny_llama(seed=0, hidden_size=64, scale=3.0).with_kv_cache(f"int{bits}:group=8,residual=64")
    ids = torch.tensor([tokens(200)])
    whole = torch.cat([backend.append(part).logits for part in ids.split(64, dim=1)], 1)
    for cut in (17, 1):
        backend.reset(1)
        pieces = torch.cat([backend.append(part).logits for part in ids.split(cut, dim=1)], 1)
        assert torch.equal(pieces, whole), cut
    full = tiny_llama(seed=0, hidden_size=64, scale=3.0)
    plain = torch.cat([full.append(part).logits for part in ids.split(64, dim=1)], 1)
    assert torch.equal(plain[:, :71], whole[:, :71])  # before position 71 every query reads floats only
    assert not torch.equal(plain[:, 71], whole[:, 71])  # position 71 reads positions 0..7 from codes


def test_int4_one_call_layers_give_the_layer_loops_bits():
    """forward.c reads the codes through the pass's KiviView; the layer loop through the same kernel."""
    one_call = tiny_llama(seed=0, hidden_size=64, scale=3.0).with_kv_cache("int4:group=8,residual=64")
    loop = one_call.clone()
    loop._stack = None
    ids = torch.tensor([tokens(160)])
    for backend in (one_call, loop):
        backend.append(ids[:, :100])
    assert one_call._stack is not None and one_call._kivi.tokens > 0
    for part in ids[:, 100:].split([1, 7, 1, 51], dim=1):
        assert torch.equal(one_call.append(part).logits, loop.append(part).logits)


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_cache_speculation_is_lossless_relative_to_its_greedy(bits):
    engine = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64, scale=3.0).with_kv_cache(f"int{bits}:group=8,residual=64"),
                                CharTokenizer(96), "tiny"))
    prompt = tokens(80)
    want = engine.generate(prompt, max_new_tokens=80, ignore_eos=True).tokens
    for method in ("pld", "suffix", "recycling"):  # chains and trees
        got = engine.generate(prompt, method=method, max_new_tokens=80, ignore_eos=True, budget=4)
        assert got.tokens == want, method
        assert got.stats.extra["verifications"] > 0
    with pytest.raises(InvalidParameter, match="kvdraft"):
        engine.generate(prompt, method="kvdraft", max_new_tokens=4)
    with pytest.raises(InvalidParameter, match="other than int4"):
        Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64), CharTokenizer(96), "tiny")).generate(
            prompt, method="kvdraft", draft_cache="int4", max_new_tokens=4)


def test_a_drafter_on_the_models_own_cache_drafts_no_further_than_it_can_roll_back(monkeypatch):
    """layerskip's chain and the cost table's timed passes are rolled back: under int4 with the
    shortest residual (one pass) and a sink window shorter than the timed passes, they stay within
    what the cache can roll back (one line, never a ValueError), and int4 layerskip is int4 greedy."""
    from decodekit.errors import RollbackRefused
    from decodekit.speculative import controller
    from decodekit.speculative.controller import CostTable

    prompt = tokens(80)
    engine = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64, scale=3.0).with_kv_cache("int4:group=8,residual=64"),
                                CharTokenizer(96), "tiny"))
    want = engine.generate(prompt, max_new_tokens=40, ignore_eos=True).tokens
    got = engine.generate(prompt, method="layerskip", max_new_tokens=40, ignore_eos=True, budget=4)
    assert got.tokens == want and got.stats.extra["verifications"] > 0
    sink = tiny_llama(seed=0, hidden_size=64).with_kv_cache("sink:2,window:8,every:1")
    passes = []
    monkeypatch.setattr(type(sink), "_forward", lambda self, *a, _f=type(sink)._forward, **k: passes.append(1) or _f(self, *a, **k))
    monkeypatch.setattr(controller, "RUN_S", 0.0)  # two passes a size
    table = CostTable.measure(sink, sizes=(1, 4, 16, 32), rounds=1)  # passes past the window, on a twin
    assert set(table.sizes) == {1, 4, 16, 32} and sink.length == 0
    # timed on a full cache after at most the window's peak entries, each pass rolled back: not
    # after a context read again a few tokens at a time after every pass (thousands of passes)
    assert table.at <= sink.kv_policy.peak_slots(32) and len(passes) < 40
    monkeypatch.undo()
    # a window whose peak is past a short model's context (a sink cache runs past it): timed within the
    # full-cache twin's context, which holds the model's positions only
    short = tiny_llama(seed=0, hidden_size=64, max_position=64).with_kv_cache("sink:4,window:32")
    assert short.kv_policy.peak_slots(32) > 64
    table = CostTable.measure(short, sizes=(1, 4, 32), rounds=1)
    assert set(table.sizes) == {1, 4, 32} and table.at <= 64 - 32 - 1
    short_engine = Engine(LoadedModel(short, CharTokenizer(96), "tiny"))
    assert len(short_engine.generate(prompt, method="pld", max_new_tokens=100, ignore_eos=True).tokens) == 100
    heavy = tiny_llama(seed=0, hidden_size=64).with_kv_cache("h2o:budget=16,window=4")  # no peak: its own twin
    table = CostTable.measure(heavy, sizes=(1, 4, 32), rounds=1)  # a pass past the budget cannot be rolled back
    assert set(table.sizes) == {1, 4, 32} and heavy.length == 0
    engine = Engine(LoadedModel(sink, CharTokenizer(96), "tiny"))
    for method in ("pld", "layerskip"):
        assert len(engine.generate(prompt, method=method, max_new_tokens=24, ignore_eos=True).tokens) == 24
    sink.prefill(tokens(30))
    with pytest.raises(RollbackRefused, match="evicted"):  # what the callers above keep clear of
        sink.truncate(10)


def test_int4_rollback_reaches_back_residual_minus_64_tokens_before_the_last_pass():
    def cache():
        return tiny_llama(seed=0, hidden_size=64).with_kv_cache("int4:group=8,residual=96")

    backend = cache()
    backend.prefill(tokens(150))  # passes at 0, 64 and 128; the last quantised positions below (149 + 1 - 96) // 8 * 8
    assert backend._kivi.tokens == 48
    with pytest.raises(ValueError, match="roll back"):
        backend.truncate(128 - 32 - 1)
    backend.truncate(128 - 32)
    again = backend.append(torch.tensor([tokens(70, seed=1)])).logits
    fresh = cache()
    fresh.prefill(tokens(150)[:96])
    assert torch.equal(fresh.append(torch.tensor([tokens(70, seed=1)])).logits, again)


def test_a_window_without_room_for_a_long_pass_is_one_line_not_a_traceback():
    """A window whose cache nearly fills the context has no room for a long verification pass: the
    pass is refused as a DecodeKitError (one line on the command line), naming the cache."""
    from decodekit.errors import DecodeKitError

    backend = tiny_llama(seed=0, hidden_size=64, max_position=64).with_kv_cache("sink:2,window:54,every:4")
    backend.prefill(tokens(80))
    with pytest.raises(DecodeKitError, match=r"^kv cache sink:2,window:54,every:4: a pass reaching cache slot \d+ goes past"):
        backend.verify_tree(torch.tensor([5] * 12), list(range(-1, 11)))


@pytest.mark.parametrize("method", ["pld", "lookahead"])
def test_speculation_under_a_window_near_the_context_keeps_its_trees_within_it(method):
    """A window whose entries nearly fill the context leaves a verification little room: the loop
    drafts no deeper than the slots left, so generation runs on past the context window."""
    backend = tiny_llama(seed=0, hidden_size=64, max_position=64).with_kv_cache("sink:2,window:54,every:4")
    engine = Engine(LoadedModel(backend, CharTokenizer(96), "tiny"))
    prompt = tokens(20) * 4  # repeats: drafts to verify
    out = engine.generate(prompt, method=method, max_new_tokens=100, ignore_eos=True, budget=32)
    assert len(out.tokens) == 100 and out.stats.extra["verifications"] > 0


# Found by a mutation hunt: what the tests above left open --------------------------------------------------


def test_an_h2o_window_may_fill_the_whole_budget():
    """``h2o:budget=B,window=W`` needs 1 <= W <= B: W == B (only the recent window, no heavy hitters) is valid."""
    assert parse_kv_cache("h2o:budget=8,window=8") == HeavyHitterPolicy(8, 8)
    assert heavy_hitter_keep(torch.arange(12.0).expand(1, 1, 12), budget=8, window=8).tolist() == [[list(range(4, 12))]]


def test_a_streaming_window_under_eight_tokens_compacts_a_token_at_a_time():
    """``every`` defaults to window // 8, at least 1: a window of 4 still reads a prompt and compacts."""
    policy = parse_kv_cache("sink:1,window:4")
    assert policy.step == 1 and policy.prefill_chunk() == 1
    backend = tiny_llama(seed=0, hidden_size=64).with_kv_cache(policy)
    backend.prefill(tokens(12))
    assert (backend.length, backend.slots) == (12, 6)  # 1 + 4 + 1 before the next pass compacts
    assert backend._held[0, 0, :6].tolist() == [0] + list(range(7, 12))


def test_a_token_written_to_a_slot_starts_with_no_accumulated_attention():
    """H2O's score of an entry is the attention it has received: a slot written again after a rollback
    starts from zero, so its mass is that of the same sequence read without the rolled-back pass."""
    ids = tokens(20, seed=3)
    rolled = tiny_llama(seed=5, hidden_size=64).with_kv_cache("h2o:budget=64,window=4")
    rolled.prefill(ids[:16])
    rolled.append(torch.tensor([[9, 8, 7, 6]]))  # a pass that is rolled back
    rolled.truncate(16)
    fresh = tiny_llama(seed=5, hidden_size=64).with_kv_cache("h2o:budget=64,window=4")
    fresh.prefill(ids[:16])
    for backend in (rolled, fresh):
        for t in ids[16:]:
            backend.step(torch.tensor([t]))
    # slots 16..19 were written twice in `rolled`: only the second tokens' attention counts there
    assert torch.allclose(rolled._mass[..., 16:20], fresh._mass[..., 16:20], atol=1e-5)
    assert not torch.allclose(rolled._mass[..., :16], fresh._mass[..., :16], atol=1e-5)  # rolled-back rows still count there


def adopted_and_read(policy: str, prompt_length: int):
    """The target's full cache of a prompt, a ``policy`` cache adopted from it, and one that read the
    prompt itself (the cache adopting must keep what reading keeps)."""
    target = tiny_llama(seed=2, hidden_size=64)
    prompt = tokens(prompt_length)
    target.prefill(prompt)
    adopted = target.with_kv_cache(policy)
    adopted.adopt(target, prompt)
    read = tiny_llama(seed=2, hidden_size=64).with_kv_cache(policy)
    read.prefill(prompt)
    return target, adopted, read


def test_an_adopted_streaming_cache_compacts_only_where_reading_the_prompt_would():
    """A cache adopted from the target keeps what the policy keeps after the prompt: a streaming cache
    compacts at sink + window + every entries, so a 12-token prompt under sink:2,window:8,every:4 is kept whole."""
    target, adopted, read = adopted_and_read("sink:2,window:8,every:4", 12)
    assert (adopted.length, adopted.slots) == (read.length, read.slots) == (12, 12)
    assert adopted._held[0, 0, :12].tolist() == read._held[0, 0, :12].tolist() == list(range(12))
    assert torch.equal(adopted._v[:, 0, :, :12], target._v[:, 0, :, :12])


@pytest.mark.parametrize("hidden", SIZES)
def test_a_windowed_pass_attends_to_the_sinks_and_the_window_only(hidden):
    """``append_windowed`` (kvdraft's draft passes): StreamingLLM's attention without evicting. The
    reference is a cache that holds only the sinks and the window (moved to the front, keys still
    rotated by their own positions), read at the same positions."""
    prompt, sink, window = tokens(30, seed=1), 3, 7
    windowed = tiny_llama(seed=4, hidden_size=hidden)
    windowed.prefill(prompt)
    reference = windowed.clone()
    reference.prefill(prompt)
    keep = streaming_keep(30, sink, window)
    with torch.inference_mode():  # (the cache's tensors are inference tensors)
        reference._move_entries(keep, 0)
    reference._slots = keep.numel()  # the next pass: slot 10, position 30
    new = torch.tensor([tokens(3, seed=2)])
    got = windowed.append_windowed(new, sink, window).logits
    want = reference.append(new).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert windowed.length == 33 and windowed.slots == 33  # nothing evicted


def test_an_adopted_snapkv_cache_of_exactly_its_budget_keeps_every_generated_token():
    """SnapKV compresses the prompt only (its first pass): a prompt of exactly ``budget`` tokens is left
    whole, and the tokens generated after it are all kept, adopted or read alike."""
    _, adopted, read = adopted_and_read("snapkv:budget=20,window=4", 20)
    for cache in (adopted, read):
        for t in (5, 6, 7):
            cache.step(torch.tensor([t]))
        assert (cache.length, cache.slots) == (23, 23)
        assert cache._held[0, 0, :23].tolist() == list(range(23))


def test_kivi_drops_float_rows_as_soon_as_a_whole_group_is_read_from_codes_only():
    """The residual keeps the float rows a later query still reads: before each pass, those below
    ``quantised_end`` of the lowest later query are dropped once they make a group, so fewer than a
    group of them is ever left (here rollback reaches 0 tokens back: residual 64)."""
    backend = tiny_llama(seed=0, hidden_size=64).with_kv_cache("int4:group=8,residual=64")
    policy = backend.kv_policy
    backend.append(torch.tensor([tokens(100)]))
    for t in tokens(40, seed=2):
        before = backend.length
        backend.step(torch.tensor([t]))
        assert 0 <= int(policy.quantised_end(torch.tensor(before))) - backend._base < policy.group, before
    assert backend._k.shape[3] == 64 + 2 * 8 + 64  # never grown past what reset allocated


def test_an_evicting_cache_counts_each_entrys_position_and_attention_mass():
    """``cache_bytes``: the keys and values held plus, under H2O and SnapKV, each entry's position (int64)
    and accumulated attention (float32), per layer and key/value head; ``peak=True``: at the most entries held."""
    full = tiny_llama(seed=0, hidden_size=64)
    heavy = full.with_kv_cache("h2o:budget=20,window=4")
    ids = tokens(30)
    full.prefill(ids[:21])
    heavy.prefill(ids)  # 64 a pass: 30 entries at once, then nothing to evict before the next pass
    heavy.step(torch.tensor([5]))  # evicts down to 20 first
    c = full.config
    assert heavy.slots == 21
    assert heavy.cache_bytes() == full.cache_bytes() + c.num_layers * c.num_kv_heads * 21 * (8 + 4)
    full.prefill(ids)
    assert heavy.cache_bytes(peak=True) == full.cache_bytes() + c.num_layers * c.num_kv_heads * 30 * (8 + 4)


@pytest.mark.parametrize("method", ["astar", "particle"])
def test_a_one_sequence_search_judged_under_a_small_window_reads_again_what_it_cannot_roll_back_to(method):
    """A judge's question after a step can push the step's beginning out of a sink window: the
    search's next fork reads its prefix again instead of refusing the rollback."""
    tok = CharTokenizer(96)
    engine = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64, max_position=1024, scale=2.0)
                                .with_kv_cache("sink:2,window:16"), tok, "tiny"))
    prompt = tok.encode("Q: 2+2? A: the cat sat on the mat\n\n" * 3)
    got = engine.generate(prompt, method=method, n=1, scorer="judge", max_step_tokens=8, delimiter=" ",
                          max_new_tokens=40, chat=False)
    assert got.tokens


def test_a_prefix_cache_reads_again_what_an_evicting_cache_cannot_roll_back_to():
    """Where rolling back to the shared prefix is past the cache's floor, the fork reads the ids
    afresh (a prefill), and its logits are those of that prefill; within the floor it rolls back."""
    from decodekit.search.cache import PrefixCache

    backend = tiny_llama(seed=0, hidden_size=64).with_kv_cache("sink:2,window:16")
    cache = PrefixCache(backend)
    ids = tokens(60)
    cache.fork(ids)
    assert backend.rollback_floor() > 30  # compacted as it read
    logits = cache.fork(ids[:30] + tokens(5, seed=1))
    fresh = tiny_llama(seed=0, hidden_size=64).with_kv_cache("sink:2,window:16")
    assert torch.equal(logits, fresh.prefill(ids[:30] + tokens(5, seed=1)))
    assert backend.length == 35 and cache.tokens_run == 60 + 35
    row = ids[:30] + tokens(5, seed=1)
    assert backend.rollback_floor() <= 33
    cache.fork(row[:33] + tokens(2, seed=2))  # within reach: rolled back to 33, two read
    assert backend.length == 35 and cache.tokens_run == 60 + 35 + 2
    floor, run = backend.rollback_floor(), cache.tokens_run
    cache.fork(row[:floor] + tokens(2, seed=3))  # exactly as far back as it reaches: rolled back too
    assert cache.tokens_run == run + 2


def test_a_speculative_chain_under_a_window_stays_within_the_models_positions():
    """A window's positions are its slots: a verification (the root and its drafts) fits the slots
    the context leaves, with room for the root, however large the budget."""
    tok = CharTokenizer(96)
    engine = Engine(LoadedModel(tiny_llama(seed=0, hidden_size=64, max_position=48, scale=3.0)
                                .with_kv_cache("sink:4,window:32"), tok, "tiny"))
    prompt = tok.encode("abcabcabcabcabcabcabc")
    got = engine.generate(prompt, method="pld", budget=12, max_new_tokens=150, ignore_eos=True, chat=False)
    assert len(got.tokens) == 150 and got.stats.extra["verifications"] > 0


def test_snapkv_observes_the_attention_of_exactly_the_prompts_it_compresses():
    """SnapKV leaves a prompt of at most ``budget`` tokens whole: only a prompt it compresses needs its
    observation window's attention (which takes the slower, observed path), and only its first pass."""
    policy = SnapKVPolicy(budget=20, window=6)
    for before, incoming in [(0, 19), (0, 20), (0, 21), (0, 40), (0, 3), (15, 5), (15, 6)]:
        compresses = policy.compress_after(before + incoming, first_pass=True)
        assert compresses == (before + incoming > 20)
        assert policy.observation_rows(before, incoming, first_pass=True) == (min(6, incoming) if compresses else 0)
        assert policy.observation_rows(before, incoming, first_pass=False) == 0


def test_a_snapkv_cache_rolls_back_through_its_observation_window_and_no_further():
    """After the prompt is compressed, its last ``window`` tokens are held in the last slots, in order (a
    rollback into them moves a counter); the token before them may have been evicted: refused."""
    backend = tiny_llama(seed=6, hidden_size=64).with_kv_cache("snapkv:budget=20,window=6")
    backend.prefill(tokens(40, seed=4))
    assert (backend.slots, backend.length) == (20, 40)
    backend.truncate(37)
    assert backend.slots == 17 and backend._held[..., 14:17].tolist() == [[[34, 35, 36]] * 2] * 2
    backend.truncate(34)  # the whole window: the prompt's heavy hitters are left
    assert backend.slots == 14 and bool((backend._held[..., :14] < 34).all())
    with pytest.raises(ValueError, match="evicted"):
        backend.truncate(33)


def test_an_h2o_cache_rolls_back_through_its_window_and_no_further():
    """After an eviction the ``window`` tokens before the pass are held in the last slots, in order (a
    rollback into them moves a counter); the token before them was ranked with the heavy hitters and
    may be gone from some heads: a rollback to it is refused."""
    backend = tiny_llama(seed=6, hidden_size=64).with_kv_cache("h2o:budget=12,window=4")
    backend.prefill(tokens(30, seed=4))  # one pass: nothing to evict before it
    backend.step(torch.tensor([5]))  # starts with 30 > 12 entries: evicts down to 12 first
    assert (backend.slots, backend.length) == (13, 31)
    held = backend._held[..., : backend.slots]
    assert held[..., 8:].tolist() == [[[26, 27, 28, 29, 30]] * 2] * 2
    assert bool((held[..., :8] < 26).all()) and not bool((held[..., :8] == 25).all())  # 25 is gone somewhere
    backend.truncate(26)  # the whole window
    assert backend.slots == 8 and torch.equal(backend._held[..., :8], held[..., :8])
    with pytest.raises(ValueError, match="evicted"):
        backend.truncate(25)
    assert (backend.slots, backend.length) == (8, 26)


def test_an_h2o_cache_that_grows_keeps_each_entrys_token_and_attention_mass():
    """Growing the cache past its initial capacity copies H2O's bookkeeping with the entries: a cache
    that started small holds, scores and evicts as one that never had to grow."""
    def cache(capacity: int):
        backend = tiny_llama(seed=1, hidden_size=64).with_kv_cache("h2o:budget=12,window=3")
        backend._initial_capacity = capacity
        backend.reset()
        backend.prefill(tokens(6))
        for t in tokens(20, seed=3):
            backend.step(torch.tensor([t]))
        return backend

    small, large = cache(8), cache(512)
    assert small._k.shape[3] > 8  # it grew, with entries held and scored
    n = large.slots
    assert small.slots == n and small.length == large.length == 26
    assert torch.equal(small._held[..., :n], large._held[..., :n])
    assert torch.allclose(small._mass[..., :n], large._mass[..., :n], atol=1e-5)


def test_a_streaming_cache_reads_a_prompt_at_most_prefill_chunk_tokens_a_pass(monkeypatch):
    """StreamingLLM reads a prompt ``every`` tokens a pass, but never more than PREFILL_CHUNK (the same
    passes alone and served, where the batcher takes no more)."""
    from decodekit.models.batching import PREFILL_CHUNK
    from decodekit.models.native import NativeLlama

    cache = tiny_llama(seed=0, hidden_size=64).with_kv_cache(f"sink:2,window:64,every:{2 * PREFILL_CHUNK}")
    passes, forward = [], NativeLlama._forward
    monkeypatch.setattr(NativeLlama, "_forward", lambda self, tokens, *a, **k: passes.append(tokens.shape[1])
                        or forward(self, tokens, *a, **k))
    cache.prefill(tokens(3 * PREFILL_CHUNK + 4))
    assert passes == [PREFILL_CHUNK] * 3 + [4]


def unfit_for_quantised_caches() -> dict:
    """Tiny models the int8 and int4 caches' kernels cannot run: bfloat16, a head size of 8, and a
    hidden size that is no multiple of 16 (no layer kernels) beside heads of 16."""
    from decodekit.models.llama_weights import LlamaConfig
    from decodekit.models.native import NativeLlama
    from decodekit.models.tiny import tiny_hf_config, tiny_state_dict

    config = tiny_hf_config(hidden_size=40) | {"head_dim": 16, "intermediate_size": 64}
    return {"bfloat16": lambda: tiny_llama(seed=0, hidden_size=64, dtype=torch.bfloat16),
            "head-8": lambda: tiny_llama(seed=0, hidden_size=32),
            "hidden-40": lambda: NativeLlama(LlamaConfig.from_hf(config), tiny_state_dict(config))}


@pytest.mark.parametrize("cache", ["int8", "int4:group=8,residual=64"])
@pytest.mark.parametrize("model", list(unfit_for_quantised_caches()))
def test_a_quantised_cache_on_a_model_its_kernels_cannot_run_is_refused_in_one_line(cache, model):
    backend = unfit_for_quantised_caches()[model]()
    backend.prefill(tokens(5))  # the model itself runs (through torch where its kernels cannot)
    with pytest.raises(InvalidParameter, match="needs a float32 model, the compiled kernels"):
        backend.with_kv_cache(cache)


def test_an_int4_cache_refuses_windowed_passes():
    """Every query reads KIVI's quantised tokens: a pass attending to a window of the cache is refused
    in one line, and the cache is left as it was."""
    backend = tiny_llama(seed=0, hidden_size=64).with_kv_cache("int4:group=8,residual=64")
    backend.prefill(tokens(20))
    with pytest.raises(InvalidParameter, match="windowed passes are not supported"):
        backend.append_windowed(torch.tensor([[3]]), 2, 8)
    assert backend.length == 20


def test_adopt_refuses_another_models_cache_a_cache_of_several_rows_and_an_int4_cache():
    prompt = tokens(30)
    target = tiny_llama(seed=2, hidden_size=64)
    target.prefill(prompt)
    longer = tiny_llama(seed=2, hidden_size=64, max_position=1024).with_kv_cache("sink:2,window:8,every:1")
    with pytest.raises(ValueError, match="same model"):  # the same shapes, another context: another model
        longer.adopt(target, prompt)
    rows = tiny_llama(seed=2, hidden_size=64)
    rows.prefill(prompt, batch_size=2)
    draft = target.with_kv_cache("sink:2,window:8,every:1")
    with pytest.raises(ValueError, match="holding one sequence"):
        draft.adopt(rows, prompt)
    draft.adopt(target, prompt)
    assert (draft.length, draft.slots) == (30, 10)
    int4 = target.with_kv_cache("int4:group=8,residual=64")
    with pytest.raises(InvalidParameter, match="cannot be made from another cache"):
        int4.adopt(target, prompt)
    assert int4.length == 0


def test_a_tree_larger_than_a_pass_is_refused_before_the_int4_cache_is_touched():
    """The int4 cache quantises ahead of a pass: a 100-node tree (more than a pass holds) quantised
    slots no token had written, then failed, and the cache gave wrong logits later. It is refused
    first, and the cache is as it was."""
    tree, same = (tiny_llama(seed=1, hidden_size=64).with_kv_cache("int4:group=8,residual=64") for _ in range(2))
    prompt = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(0))
    tree.append(prompt)
    same.append(prompt)
    with pytest.raises(InvalidParameter, match=r"a tree of 100 tokens is more than a pass holds \(64\)"):
        tree.verify_tree(torch.zeros(100, dtype=torch.long), [-1] + list(range(99)))
    for i in range(80):  # past the next quantisation
        step = torch.tensor([[i % 96]])
        assert torch.equal(tree.append(step).logits, same.append(step).logits)


def test_the_room_for_a_pass_counts_what_a_streaming_cache_keeps_once_it_compacts():
    """pass_room() under a window is the context less the entries the next pass finds, after the
    compaction it starts with: a tree of exactly that many nodes fits, one more does not."""
    def cache():
        backend = tiny_llama(seed=0, hidden_size=64, max_position=64).with_kv_cache("sink:2,window:8,every:4")
        backend.prefill(tokens(16))  # 4 a pass: 16 entries, over the 14 that compact (to 10) before a pass
        return backend

    backend = cache()
    assert backend.slots == 16 and backend.pass_room() == 64 - 10
    room = backend.pass_room()
    assert backend.verify_tree(torch.tensor(tokens(room)), list(range(-1, room - 1))).logits.shape[1] == room
    with pytest.raises(PromptTooLong):
        cache().verify_tree(torch.tensor(tokens(room + 1)), list(range(-1, room)))


def test_an_h2o_cache_commits_a_tree_path_with_its_nodes_tokens_and_attention_mass():
    """commit_path moves the accepted nodes' entries to the committed slots with what H2O knows of
    them: the token each holds (the sequence's next) and the attention it has received."""
    backend = tiny_llama(seed=1, hidden_size=64).with_kv_cache("h2o:budget=64,window=4")
    backend.prefill(tokens(10))
    backend.verify_tree(torch.tensor(tokens(4, seed=2)), [-1, 0, 0, 2])
    mass = backend._mass.clone()
    backend.commit_path([0, 2, 3])
    assert (backend.length, backend.slots) == (13, 13)
    c = backend.config
    assert backend._held[..., 10:13].tolist() == [[[10, 11, 12]] * c.num_kv_heads] * c.num_layers
    assert torch.equal(backend._mass[..., 10:13], mass[..., [10, 12, 13]])


def test_h2o_counts_a_verified_trees_attention_as_that_of_the_same_tokens_appended():
    """H2O observes every pass: a chain verified as a tree and committed leaves each entry with the
    attention it gets when the chain is appended in one pass."""
    chain = tokens(5, seed=2)
    appended, verified = (tiny_llama(seed=1, hidden_size=64).with_kv_cache("h2o:budget=64,window=4") for _ in range(2))
    for backend in (appended, verified):
        backend.prefill(tokens(10))
    before = verified._mass[..., :10].clone()
    appended.append(torch.tensor([chain]))
    verified.verify_tree(torch.tensor(chain), [-1, 0, 1, 2, 3])
    verified.commit_path(range(5))
    assert not torch.allclose(verified._mass[..., :10], before)  # the chain's queries were counted
    assert torch.allclose(verified._mass[..., :15], appended._mass[..., :15], atol=1e-5)


def test_an_int4_caches_rollback_floor_stays_put_after_a_rollback_to_it():
    """Rolling back to the floor and reading on brings back neither the quantised tokens nor the
    float rows dropped before it: the floor stays where it was, and a rollback below it is refused."""
    backend = tiny_llama(seed=0, hidden_size=64).with_kv_cache("int4:group=8,residual=96")
    backend.prefill(tokens(150))
    floor = backend.rollback_floor()
    assert floor > 0
    backend.truncate(floor)
    backend.step(torch.tensor([5]))
    assert backend.rollback_floor() == floor
    with pytest.raises(ValueError, match="roll back"):
        backend.truncate(floor - 1)


def test_a_streaming_cache_whose_entries_exactly_fill_the_context_is_taken():
    """A streaming cache holds at most sink + window + 2 every - 1 entries in one-token passes: one
    that needs exactly the model's context is taken, and decodes past it; one entry more is refused."""
    backend = tiny_llama(seed=0, hidden_size=64, max_position=64).with_kv_cache("sink:4,window:53,every:4")
    assert backend.kv_policy.peak_slots(1) == 64
    backend.prefill(tokens(70))
    for t in tokens(10, seed=1):
        backend.step(torch.tensor([t]))
    assert backend.length == 80 and backend.slots <= 64
    with pytest.raises(InvalidParameter, match="more than the model's context"):
        tiny_llama(seed=0, hidden_size=64, max_position=64).with_kv_cache("sink:4,window:54,every:4")


def test_hidden_states_of_a_prompt_a_streaming_cache_reads_in_chunks_cover_every_token():
    """A streaming cache reads a prompt in passes of ``every`` tokens: the hidden states asked for are
    those of every token (as the full cache's, while nothing is evicted), not the last pass's."""
    ids = torch.tensor([tokens(60)])
    streaming = tiny_llama(seed=0, hidden_size=64).with_kv_cache("sink:4,window:200")  # 25 a pass
    got = streaming.append(ids, hidden_layers=[1, 2])
    want = tiny_llama(seed=0, hidden_size=64).append(ids, hidden_layers=[1, 2])
    for layer in (1, 2):
        assert got.hidden[layer].shape == want.hidden[layer].shape == (1, 60, 64)
        assert torch.allclose(got.hidden[layer], want.hidden[layer], atol=1e-4)
    assert torch.allclose(got.logits, want.logits, atol=1e-4)


@pytest.mark.parametrize("spec", ["snapkv:budget=24,window=4", "h2o:budget=20,window=4", "sink:2,window:8,every:1"])
def test_a_cache_adopted_again_is_the_cache_adopted_fresh(spec):
    """adopt() starts the cache afresh: a draft cache that held another request's sequence (kvdraft
    keeps one per model) holds, scores and rolls back as a new one adopted from the same source."""
    target = tiny_llama(seed=2, hidden_size=64)
    first, second = tokens(30, seed=1), tokens(30, seed=2)
    target.prefill(first)
    used = target.with_kv_cache(spec)
    used.adopt(target, first)
    for t in tokens(5, seed=3):
        used.step(torch.tensor([t]))
    target.prefill(second)
    used.adopt(target, second)
    fresh = target.with_kv_cache(spec)
    fresh.adopt(target, second)
    assert (used.length, used.slots, used.rollback_floor()) == (fresh.length, fresh.slots, fresh.rollback_floor())
    n = fresh.slots
    assert torch.equal(used._k[:, :, :, :n], fresh._k[:, :, :, :n])
    assert torch.equal(used._held[..., :n], fresh._held[..., :n])
    assert torch.allclose(used._mass[..., :n], fresh._mass[..., :n], atol=1e-5)
    assert torch.equal(used.step(torch.tensor([7])), fresh.step(torch.tensor([7])))


@pytest.mark.parametrize("hidden", SIZES)
def test_snapkv_observes_a_window_of_more_than_256_rows_in_full(hidden):
    """The observation window's attention is computed 256 rows at a time (bounded memory; torch's
    path reads the window in one pass, the kernels' 64 rows a pass): a window longer than that ranks
    the prompt by every one of its rows' attention, as transformers gives it."""
    ids = tokens(300, seed=4)
    policy = SnapKVPolicy(budget=280, window=260, kernel=3)
    backend = tiny_llama(seed=6, hidden_size=hidden).with_kv_cache(policy)
    backend.prefill(ids)
    assert backend.slots == 280 and backend.length == 300
    for layer, weights in enumerate(transformers_attention(6, hidden, ids)):
        mass = grouped(weights[:, -260:, :].sum(1), backend.config.num_kv_heads)
        want = snapkv_keep(mass[None], 280, 260, 3)[0]
        got = backend._held[layer, :, :280]
        assert (got[:, :20] == want[:, :20]).float().mean() > 0.9, layer  # the pooled picks before the window
        assert got[:, 20:].tolist() == [list(range(40, 300))] * backend.config.num_kv_heads


def test_an_adopted_streaming_cache_rotates_keys_by_distances_its_own_passes_never_reached():
    """adopt() may take the cache of another instance of the model: the window's keys then move back
    by a distance whose rotary angles no pass of the adopting model has computed (here exactly the
    first position of the tables' second chunk); they are computed for the rotation."""
    from decodekit.models.llama_weights import ROPE_CHUNK

    n = ROPE_CHUNK + 2 + 8  # sink 2, window 8: the window's keys move back ROPE_CHUNK slots
    prompt = tokens(n)
    target = tiny_llama(seed=2, hidden_size=64, max_position=2 * ROPE_CHUNK)
    target.prefill(prompt)
    draft = tiny_llama(seed=2, hidden_size=64, max_position=2 * ROPE_CHUNK).with_kv_cache("sink:2,window:8,every:1")
    draft.adopt(target, prompt)
    assert (draft.length, draft.slots) == (n, 10)
    want = rotate(target._k[:, 0, :, streaming_keep(n, 2, 8)], [0, 0] + [-ROPE_CHUNK] * 8, target.config.rope_theta)
    assert torch.allclose(draft._k[:, 0, :, :10], want, atol=1e-3)


def test_int8_kernels_refuse_caches_of_float_rows_and_queries_of_another_head_size():
    """The int8 cache's rows are head_dim / 4 + 1 float32 elements (head_dim bytes and a scale): a
    float cache of head_dim elements a row (or a row cut short) is refused, not written or read with
    the wrong row size; so are queries of another head size (read head_dim values a query past them)."""
    from decodekit.models.kernels import int8_cache_kernels, quantise_int8_rows

    d = 16
    int8 = int8_cache_kernels(d)
    if int8 is None:
        pytest.skip("kernels unavailable")
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(1, 3 * d, generator=g)
    freqs = torch.tensor([1.0, 0.0] * (d // 2)).repeat(4, 1)
    wide = torch.zeros(1, 4, d)  # a float32 cache's rows: C wrote its slots 20 bytes apart, not 64
    with pytest.raises(ValueError, match="int8 rope_store"):
        int8.rope_store(qkv, freqs, torch.tensor([0]), wide, wide.clone(), 0, 1)
    narrow = torch.zeros(1, 4, 2)  # 2 elements a row, not d / 4 + 1 = 5: slot 3 was written past the cache's end
    with pytest.raises(ValueError, match="int8 rope_store"):
        int8.rope_store(qkv, freqs, torch.tensor([3]), narrow, narrow.clone(), 3, 1)
    packed = quantise_int8_rows(torch.randn(2, 8, d, generator=g))
    q = torch.randn(1, 2, d, generator=g)
    cut = packed[..., :-1]  # the scale cut off: the kernel read it anyway
    with pytest.raises(ValueError, match="int8 attention"):
        int8.attention(q, cut, packed.clone()[..., :-1], None, d**-0.5)
    with pytest.raises(ValueError, match="int8 attention needs queries of head_dim 16"):
        int8.attention(torch.randn(1, 2, 4, generator=g), packed, packed.clone(), None, d**-0.5)
    assert int8.attention(q, packed, packed.clone(), None, d**-0.5).isfinite().all()



def test_a_chain_on_a_cache_reaches_as_far_as_it_can_roll_back_uncompacted():
    """A drafted chain holds the cache's compaction, so an evicting cache rolls back from any length
    of chain; KIVI's codes, written as passes go, from recent + 1 passes; a window whose positions
    are its slots, from as many as the context has room for."""
    for policy in (KVPolicy(), parse_kv_cache("int8"), StreamingPolicy(2, 8, 1), HeavyHitterPolicy(8, 8), SnapKVPolicy(20, 6)):
        assert policy.one_token_passes_rolled_back() is None, policy
    assert KiviPolicy(8, 64).one_token_passes_rolled_back() == 64 - 64 + 1
    window = tiny_llama(seed=0, hidden_size=64, max_position=64).with_kv_cache("sink:2,window:8,every:1")
    window.prefill(tokens(30))
    assert window.chain_reach() == 64 - window.slots
    heavy = tiny_llama(seed=0, hidden_size=64).with_kv_cache("h2o:budget=8,window=4")
    heavy.prefill(tokens(30))
    assert heavy.chain_reach() is None and tiny_llama(seed=0, hidden_size=64).chain_reach() is None


@pytest.mark.parametrize("spec", ["sink:2,window:8,every:1", "sink:2,window:6,every:3", "h2o:budget=8,window=8",
                                  "h2o:budget=12,window=4"])
def test_a_chain_drafted_on_an_evicting_cache_and_rolled_back_leaves_what_plain_decoding_holds(spec):
    """A chain longer than the window, its compaction held, then rolled back: the cache holds what it
    held, every head's tokens (the chain used to compact the cache at every pass, and its rollback
    left the window empty); a window cache then holds what a cache never drafted on holds, so the
    logits next are the same (H2O's scores count the drafts' rows, its documented choice, so its
    later evictions may differ)."""
    base = tiny_llama(seed=0, hidden_size=64)
    drafted, plain = base.with_kv_cache(spec), base.with_kv_cache(spec)
    for backend in (drafted, plain):
        backend.prefill(tokens(30))
    for t in tokens(12, seed=2):
        drafted.step(torch.tensor([t]))
        plain.step(torch.tensor([t]))
        origin, held = drafted.length, drafted._held[..., : drafted.slots].clone()
        with drafted.compaction_held():  # a chain longer than the window: every pass past the compaction point
            for d in tokens(drafted.kv_policy.recent + 2, seed=t):
                drafted.step(torch.tensor([d]))
        drafted.truncate(origin)
        assert torch.equal(drafted._held[..., : drafted.slots], held)  # as it was, every head
        assert set(range(origin - drafted.kv_policy.recent, origin)) <= set(held[0, 0].tolist())
    if not drafted.kv_policy.observes_every_pass:
        assert torch.equal(drafted.step(torch.tensor([7])), plain.step(torch.tensor([7])))


@pytest.mark.parametrize("spec, method, options", [
    ("sink:2,window:8,every:1", "layerskip", {}), ("h2o:budget=16,window=4", "layerskip", {}),
    ("full", "kvdraft", {"draft_cache": "h2o:budget=16,window=4"}),
    ("full", "kvdraft", {"draft_cache": "h2o:budget=10,window=6"}),
])
def test_a_chain_on_an_evicting_cache_keeps_the_recent_window_through_every_rollback(monkeypatch, spec, method, options):
    """Self-speculation on the model's own evicting cache, and kvdraft's chains on a compressed copy
    (an H2O one; a window drafts on the full cache): after every rollback the cache still holds the last ``recent`` tokens of the sequence (the
    README lets the output differ from plain decoding under such a cache, not lose the newest
    context; a compressed draft would lose acceptance)."""
    from decodekit.models.native import NativeLlama

    backend = tiny_llama(seed=0, hidden_size=64, scale=2.0).with_kv_cache(spec)
    missing, truncate = [], NativeLlama.truncate

    def checked(self, length):
        truncate(self, length)
        if self.kv_policy.evicts():
            held = set(self._held[0, 0, : self.slots].tolist())
            missing.append(sum(t not in held for t in range(max(0, length - self.kv_policy.recent), length)))

    monkeypatch.setattr(NativeLlama, "truncate", checked)
    out = Engine(LoadedModel(backend, CharTokenizer(96), "tiny")).generate(
        tokens(40) * 2, method=method, max_new_tokens=60, ignore_eos=True, budget=6, **options)
    assert len(out.tokens) == 60 and out.stats.extra["verifications"] > 0
    assert len(missing) > 5 and not any(missing)
