"""Mutation check: does the test suite fail when an algorithm is wrong?

Each mutation is a deliberate bug (one exact text replacement in one file). For each, the script
copies the repository to a temporary folder, applies the mutation there, runs the tests named
for it, and reports whether they failed ("caught") or passed ("SURVIVED"). The working tree is
never touched. Exit status 1 if any mutation survived, 2 if a mutation no longer applies (the
code moved on: update its text).

    .venv/bin/python scripts/mutations.py            # every mutation
    .venv/bin/python scripts/mutations.py --list     # what they are
    .venv/bin/python scripts/mutations.py top-p-boundary keyed-verifier

Add a mutation with every algorithm: the bug a reader could plausibly write, and the tests that
must catch it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments that must fail


MUTATIONS = (
    Mutation("top-p-boundary", "src/decodekit/samplers/truncation.py",
             "_mass_before(sp) < self.top_p", "_mass_before(sp) <= self.top_p",
             ("tests/test_samplers.py",)),
    Mutation("self-consistency-last-winner", "src/decodekit/search/select.py",
             "winner, _ = majority_vote(answers)\n        index = answers.index(winner) if winner is not None else 0",
             "winner, _ = majority_vote(answers)\n        index = len(answers) - 1 - answers[::-1].index(winner) if winner is not None else 0",
             ("tests/test_search.py",)),
    Mutation("loglik-is-a-mean", "src/decodekit/search/scorers.py",
             "        return segment.loglik", "        return segment.loglik / max(1, len(segment.tokens))",
             ("tests/test_search.py",)),
    Mutation("recycling-refreshes-the-root-only", "src/decodekit/speculative/drafters/recycling.py",
             "        self.matrix[rows, : self.k] = top_k_indices(logits, self.k)",
             "        self.matrix[rows[:1], : self.k] = top_k_indices(logits[:1], self.k)",
             ("tests/test_speculative.py",)),
    Mutation("rejection-sampling-accepts-5-percent-too-often", "src/decodekit/speculative/verify.py",
             "if qx > 0 and u * qx < px:", "if qx > 0 and u * qx < 1.05 * px:",
             ("tests/test_speculative_sampling.py", "-k", "exactly")),
    Mutation("rejection-sampling-bonus-from-p-not-the-residual", "src/decodekit/speculative/verify.py",
             "            p = residual(p, q, x)\n", "",
             ("tests/test_speculative_sampling.py", "-k", "exactly")),
    Mutation("rejection-sampling-keeps-q-unnormalised-after-a-rejection", "src/decodekit/speculative/verify.py",
             "                if total_q > 0:\n                    q /= total_q", "                pass",
             ("tests/test_speculative_sampling.py", "-k", "siblings")),
    Mutation("keyed-verifier-replaced-by-rejection-sampling", "src/decodekit/speculative/verify.py",
             "return GreedyVerifier() if state.sampler.is_greedy else KeyedVerifier()",
             "return GreedyVerifier() if state.sampler.is_greedy else SamplingVerifier()",
             ("tests/test_speculative.py", "-k", "seed")),
    Mutation("keyed-draws-depend-on-the-draw-order", "src/decodekit/samplers/sampler.py",
             "return exponential_race(probs, splitmix64(self.seed ^ splitmix64(position + 1)))",
             "return int(self.sample_from(probs.reshape(1, -1))[0])",
             ("tests/test_speculative_sampling.py",)),
    Mutation("trim-ignores-draw-order", "src/decodekit/speculative/tree.py",
             "    keep = sorted(chosen - dropped)\n", "    keep = sorted(chosen)\n",
             ("tests/test_speculative_sampling.py",)),
    Mutation("cost-ignores-the-context", "src/decodekit/speculative/controller.py",
             "        if context is None or not any(self.slopes):", "        if True:",
             ("tests/test_speculative.py",)),
    Mutation("cost-table-keeps-a-stalled-size", "src/decodekit/speculative/controller.py",
             "rows = {context: _non_decreasing(row) for context, row in rows.items()}", "rows = dict(rows)",
             ("tests/test_speculative.py", "-k", "never_prices")),
    Mutation("cost-table-context-term-per-size", "src/decodekit/speculative/controller.py",
             "per_context={n: a + b * n for n in table})", "per_context={n: max(0.0, slopes[n]) for n in table})",
             ("tests/test_speculative.py", "-k", "one_line")),
    Mutation("no-gain-margin", "src/decodekit/speculative/controller.py",
             "GAIN_MARGIN = 0.05", "GAIN_MARGIN = 0.0",
             ("tests/test_speculative.py",)),
    Mutation("governor-keeps-torchs-count", "src/decodekit/models/threads.py",
             "        if threads != torch.get_num_threads():\n            torch.set_num_threads(threads)\n",
             "", ("tests/test_threads.py",)),
    Mutation("integer-kernel-rounds-the-offset-product", "src/decodekit/models/kernels/gemm_q8.c",
             "                else if (kind != KIND_Q8_0 && kind != KIND_Q5_0)\n"
             "                    acc[g][t] = _mm512_fmadd_ps(s1[g], _mm512_set1_ps(in->ex[at]), acc[g][t]);",
             "                else if (kind != KIND_Q8_0 && kind != KIND_Q5_0)\n"
             "                    acc[g][t] = _mm512_fmadd_ps(s1[g], _mm512_set1_ps(in->ex[at]), _mm512_setzero_ps()) + acc[g][t];",
             ("tests/test_gguf_blocks.py", "-k", "integer")),
    Mutation("integer-kernel-forgets-the-q8_0-correction", "src/decodekit/models/kernels/gemm_q8.c",
             "int32_t correction = kind == KIND_Q8_0 ? in->cx[at]", "int32_t correction = kind == KIND_Q8_0 ? 0",
             ("tests/test_gguf_blocks.py", "-k", "integer")),
    Mutation("batched-attention-misses-the-last-key", "src/decodekit/models/kernels/forward.c",
             "    int n_keys = (int)(q->start + q->rows - lo);", "    int n_keys = (int)(q->start + q->rows - lo - 1);",
             ("tests/test_kernels.py", "tests/test_batching.py")),
    Mutation("fast-prefill-not-chunked", "src/decodekit/models/native.py",
             'if self.numerics == "fast" and self._one_call(tokens, hidden_layers, skip_layers):\n            chunks.append(MAX_ROWS)',
             'if self.numerics == "fast" and self._one_call(tokens, hidden_layers, skip_layers):\n            pass',
             ("tests/test_batching.py",)),
    Mutation("serve-gives-every-choice-the-same-seed", "src/decodekit/serve/app.py",
             'params["seed"] = (params["seed"] + i) % SEED_LIMIT', 'params["seed"] = params["seed"] % SEED_LIMIT',
             ("tests/test_serve.py",)),
    Mutation("grammar-that-matches-nothing-compiles", "src/decodekit/models/tokenizer.py",
             "                for failed in (matcher, probe):", "                for failed in (matcher,):",
             ("tests/test_constraint.py", "-k", "bad_constraints")),
    Mutation("penalties-past-float32", "src/decodekit/samplers/params.py",
             "subtract penalty * count of each seen token\", lo=-FLOAT32_MAX, hi=FLOAT32_MAX",
             "subtract penalty * count of each seen token\"", ("tests/test_bad_input.py", "-k", "before_the_model")),
    Mutation("longctx-continuation-past-the-context-runs", "src/decodekit/eval/longctx.py",
             "    if length + config.continuation > backend.info.max_length:", "    if False:",
             ("tests/test_longctx.py", "-k", "continuation")),
    Mutation("serve-seeds-do-not-wrap", "src/decodekit/serve/app.py",
             'params["seed"] = (params["seed"] + i) % SEED_LIMIT', 'params["seed"] = params["seed"] + i',
             ("tests/test_serve.py", "-k", "400s")),
    Mutation("serve-takes-local-options-from-requests", "src/decodekit/serve/app.py",
             "if local is not None and local(value):", "if False:", ("tests/test_serve.py", "-k", "400s")),
    Mutation("serve-stream-error-without-done", "src/decodekit/serve/app.py",
             "yield f\"data: {json.dumps({'error': error})}\\n\\n\"\n            yield \"data: [DONE]\\n\\n\"",
             "yield f\"data: {json.dumps({'error': error})}\\n\\n\"", ("tests/test_serve.py", "-k", "400s")),
    Mutation("kept-prefix-truncated-one-short", "src/decodekit/models/backend.py",
             "            self.truncate(shared)\n", "            self.truncate(shared - 1)\n", ("tests/test_batching.py",)),
    Mutation("engine-drops-the-eta-parameter", "src/decodekit/engine/api.py",
             "    params = {k: v for k, v in params.items() if v is not None}",
             "    params = {k: v for k, v in params.items() if v is not None and k != 'eta'}",
             ("tests/test_engine.py",)),
    Mutation("h2o-keeps-the-lightest", "src/decodekit/models/kv_policy.py",
             "chosen = older.sort(dim=-1, descending=True, stable=True)", "chosen = older.sort(dim=-1, descending=False, stable=True)",
             ("tests/test_kv_policy.py", "-k", "heavy_hitter or h2o")),
    Mutation("snapkv-without-pooling", "src/decodekit/models/kv_policy.py",
             "pooled = F.avg_pool1d(prefix.reshape(L * H, 1, m), kernel, stride=1, padding=kernel // 2).view(L, H, m)",
             "pooled = prefix", ("tests/test_kv_policy.py", "-k", "snapkv")),
    Mutation("attention-mass-of-one-head-per-group", "src/decodekit/models/native.py",
             "self._mass[layer, :, :end] += scores.softmax(-1).sum(dim=(0, 2))",
             "self._mass[layer, :, :end] += scores.softmax(-1).sum(dim=0)[:, 0]",
             ("tests/test_kv_policy.py", "-k", "accumulates or ranks")),
    Mutation("streaming-moves-keys-without-rotating-them", "src/decodekit/models/native.py",
             "                if self.kv_policy.reassigns_positions:\n                    self._rotate_keys(n, keep - torch.arange(n))\n",
             "", ("tests/test_kv_policy.py", "-k", "streaming")),
    Mutation("int8-cache-truncates-instead-of-rounding", "src/decodekit/models/kernels/layer_ops.c",
             "_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(", "_mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(",
             ("tests/test_kv_policy.py", "-k", "int8")),
    Mutation("int4-keys-quantised-per-token", "src/decodekit/models/kivi.py",
             "low, high = x.amin(dim=-2, keepdim=True), x.amax(dim=-2, keepdim=True)",
             "low, high = x.amin(dim=(-2, -1), keepdim=True), x.amax(dim=(-2, -1), keepdim=True)",
             ("tests/test_kv_policy.py", "-k", "kivi or int4")),
    Mutation("int4-kernel-ignores-the-key-minimum", "src/decodekit/models/kernels/attention.c",
             "kv[c] = _mm512_fmadd_ps(kv[c], ks[c], km[c]);", "kv[c] = _mm512_mul_ps(kv[c], ks[c]);",
             ("tests/test_kv_policy.py", "-k", "kivi_attention")),
    Mutation("int2-chunks-unpacked-out-of-order", "src/decodekit/models/kernels/attention.c",
             "    out[1] = codes_to_floats(_mm_unpackhi_epi64(a, b));", "    out[1] = codes_to_floats(_mm_unpacklo_epi64(c, d));",
             ("tests/test_kv_policy.py", "-k", "kivi_attention")),
    Mutation("int4-quantised-end-from-the-pass-not-the-row", "src/decodekit/models/native.py",
             "KiviView(self._kivi, self._base, self.kv_policy.quantised_end(positions))",
             "KiviView(self._kivi, self._base, self.kv_policy.quantised_end(positions.max()).expand(len(positions)))",
             ("tests/test_kv_policy.py", "-k", "kivi or int4")),
    Mutation("int4-residual-dropped-too-early", "src/decodekit/models/native.py",
             "drop = int(policy.quantised_end(torch.tensor(self._tail_from))) - self._base",
             "drop = self._kivi.tokens - self._base",
             ("tests/test_kv_policy.py", "-k", "kivi or int4")),
    Mutation("cost-table-measured-on-a-cache-that-cannot-roll-back", "src/decodekit/speculative/controller.py",
             "in_place = policy is None or policy.rolls_back_anywhere()", "in_place = True",
             ("tests/test_speculative.py", "-k", "twin")),
    Mutation("cost-table-measured-at-the-prompt-length-alone", "src/decodekit/speculative/controller.py",
             "contexts = sorted({max(1, min(c, limit)) for c in MEASURE_CONTEXTS})",
             "contexts = sorted({max(start, 1, min(c, limit)) for c in MEASURE_CONTEXTS})",
             ("tests/test_speculative.py", "-k", "long_prompt")),
    Mutation("governor-times-windowed-drafts", "src/decodekit/models/native.py",
             "plain_step = tokens.numel() == 1 and not skip_layers and mask is None",
             "plain_step = tokens.numel() == 1 and not skip_layers",
             ("tests/test_threads.py", "-k", "plain_steps_only")),
    Mutation("bench-skips-the-collection-before-a-timed-run", "src/decodekit/bench/runner.py",
             "    charged to whichever run it happens to fall in.\"\"\"\n    gc.collect()",
             "    charged to whichever run it happens to fall in.\"\"\"\n    pass",
             ("tests/test_bench.py", "-k", "timed_runs")),
    Mutation("bench-leaves-the-process-objects-frozen", "src/decodekit/bench/runner.py",
             "        gc.unfreeze()", "        pass", ("tests/test_bench.py", "-k", "timed_runs")),
    Mutation("bench-unfreezes-the-callers-frozen-objects", "src/decodekit/bench/runner.py",
             "        if not callers_own:\n            gc.unfreeze()", "        gc.unfreeze()",
             ("tests/test_bench.py", "-k", "timed_runs")),
    Mutation("compiled-grammar-shared-not-copied", "src/decodekit/models/tokenizer.py",
             "            return matcher.deep_copy()", "            return matcher",
             ("tests/test_constraint.py", "-k", "compiled_once")),
    Mutation("block-match-record-trusted-whatever-its-key", "src/decodekit/models/gguf_blocks.py",
             'isinstance(saved, dict) and saved.get("key") == self.key else None',
             'isinstance(saved, dict) else None', ("tests/test_cache_integrity.py", "-k", "match_record")),
    Mutation("block-match-record-ignored", "src/decodekit/models/llama_weights.py",
             "[self._blocks.get(n) for n in names], weight, orders, recorded)",
             "[self._blocks.get(n) for n in names], weight, orders, None)",
             ("tests/test_gguf_blocks.py", "-k", "recorded")),
    Mutation("tied-head-recorded-as-unmatched-still-on-blocks", "src/decodekit/models/llama_weights.py",
             "if self._blocks is None or name not in self._blocks or self._matches.get(TIED_HEAD) is False:",
             "if self._blocks is None or name not in self._blocks:",
             ("tests/test_gguf_blocks.py", "-k", "recorded")),
    Mutation("chat-template-without-lstrip-blocks", "src/decodekit/models/chat_template.py",
             "ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,",
             "ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=False,", ("tests/test_chat_template.py",)),
    Mutation("chat-template-reasoning-not-aliased", "src/decodekit/models/chat_template.py",
             "out.append(message if reasoning is None else", "out.append(message if True else",
             ("tests/test_chat_template.py",)),
    Mutation("q4_1-scale-and-minimum-swapped", "src/decodekit/models/kernels/gemm.c",
             "__m512 d = _mm512_broadcastss_ps(both), m = _mm512_broadcastss_ps(_mm_movehdup_ps(both));",
             "__m512 m = _mm512_broadcastss_ps(both), d = _mm512_broadcastss_ps(_mm_movehdup_ps(both));",
             ("tests/test_gguf_blocks.py",)),
    Mutation("attention-group-share-reads-the-first-heads", "src/decodekit/models/kernels/attention.c",
             "int first = *kv * p->group + share * p->per_job;", "int first = *kv * p->group;", ("tests/test_kernels.py",)),
    Mutation("int8-attention-weighs-every-head-by-the-first", "src/decodekit/models/kernels/attention.c",
             "s->scores[m * s->stride + t] * vscale", "s->scores[t] * vscale",
             ("tests/test_kv_policy.py", "-k", "int8_attention")),
    Mutation("attention-mask-runs-found-from-the-wrong-end", "src/decodekit/models/kernels/attention.c",
             "if (found) return j + __builtin_ctzll(found);", "if (found) return j + (63 - __builtin_clzll(found));",
             ("tests/test_kernels.py", "-k", "masked_query")),
    Mutation("kvdraft-leaves-its-draft-in-the-cache", "src/decodekit/speculative/drafters/kvdraft.py",
             "            self._target.truncate(self._origin)", "            pass",
             ("tests/test_kv_policy.py", "-k", "kvdraft_greedy")),
    Mutation("positions-past-the-window-not-checked", "src/decodekit/models/native.py",
             "        if end > self.config.max_position:\n            hint", "        if False:\n            hint",
             ("tests/test_kv_policy.py", "-k", "stop_at_the_context")),
    Mutation("text-streamer-decodes-everything-every-step", "src/decodekit/engine/core.py",
             "    SETTLE = 64\n", "    SETTLE = 10**9\n", ("tests/test_engine.py", "-k", "long_stream")),
    Mutation("broken-constraint-returned-as-a-result", "src/decodekit/engine/core.py",
             "        if broken is not None:  # never", "        if False:  # never",
             ("tests/test_constraint.py", "-k", "breaks")),
    Mutation("served-streaming-cache-reads-prompts-in-other-chunks", "src/decodekit/models/native.py",
             "        if evicting is not None:\n            return min(evicting, PREFILL_CHUNK)\n"
             "        if self._batched(tokens, hidden_layers, skip_layers):\n            return PREFILL_CHUNK\n",
             "        if self._batched(tokens, hidden_layers, skip_layers):\n            return PREFILL_CHUNK\n"
             "        if evicting is not None:\n            return min(evicting, PREFILL_CHUNK)\n",
             ("tests/test_batching.py", "-k", "compressed")),
    Mutation("bench-repeats-keep-what-they-learnt", "src/decodekit/bench/runner.py",
             "            restart(self.kept, self.prompt_ids, self.config, self.notes)", "            pass",
             ("tests/test_bench.py",)),
    Mutation("gemma-window-one-key-too-many", "src/decodekit/models/gemma3.py",
             "visible = key_positions[None, :] > positions[:, None] - window",
             "visible = key_positions[None, :] >= positions[:, None] - window",
             ("tests/test_gemma3.py",)),
    Mutation("gemma-window-one-key-too-many-in-c", "src/decodekit/models/kernels/forward.c",
             "(uint8_t)(seen && position > q->positions[r] - window)",
             "(uint8_t)(seen && position >= q->positions[r] - window)",
             ("tests/test_gemma3.py",)),
    Mutation("gemma-norm-without-the-offset", "src/decodekit/models/gemma3.py",
             "return 1.0 + weight.float() if name.endswith(\"norm.weight\") else weight",
             "return weight.float() if name.endswith(\"norm.weight\") else weight",
             ("tests/test_gemma3.py", "-k", "transformers")),
    Mutation("gemma-keys-not-normalised-in-c", "src/decodekit/models/kernels/forward.c",
             "                m->add_rms_norm(at + q_width * es, NULL, l->k_norm, at + q_width * es, (int)m->n_kv_heads,\n                                (int)m->head_dim, eps);\n",
             "",
             ("tests/test_gemma3.py",)),
    Mutation("q4k-minimum-from-the-scale-bits", "src/decodekit/models/kernels/gguf.h",
             "*min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);", "*min = (q[j + 4] >> 4) | ((q[j - 4] >> 6) << 4);",
             ("tests/test_gguf_blocks.py", "-k", "file_block")),
    Mutation("q6k-second-half-with-the-first-scale", "src/decodekit/models/kernels/gemm_q8.c",
             "acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[g][1]), _mm512_mul_ps(s1[g], dx), acc[g][t]);",
             "acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[g][1]), _mm512_mul_ps(s0[g], dx), acc[g][t]);",
             ("tests/test_gguf_blocks.py", "-k", "k_quants")),
    Mutation("q5_0-fifth-bit-of-the-wrong-weight", "src/decodekit/models/kernels/gemm_q8.c",
             "out[256 + chunk * 8 + slot / 8] |= (uint8_t)((sub.u[k] >> 4) << (slot % 8));",
             "out[256 + chunk * 8 + slot / 8] |= (uint8_t)((sub.u[k] >> 4) << ((slot + 1) % 8));",
             ("tests/test_gguf_blocks.py", "-k", "k_quants")),
    Mutation("batch-budget-counts-only-its-own-tokens", "src/decodekit/speculative/controller.py",
             "return (others + expected) / (self.pass_cost(other_rows + rows) + self.overhead + extra_s)",
             "return expected / (self.pass_cost(other_rows + rows) + self.overhead + extra_s)",
             ("tests/test_speculative.py", "-k", "batch")),
    Mutation("trained-drafter-keeps-the-wrong-features", "src/decodekit/speculative/drafters/base.py",
             "rows = [0] + [i + 1 for i in verdict.path]", "rows = [0] + [i for i in verdict.path]",
             ("tests/test_trained_drafters.py", "-k", "every_position")),
    Mutation("medusa-head-trained-one-token-short", "src/decodekit/speculative/trained/networks.py",
             "shift = k + 2", "shift = k + 1", ("tests/test_trained_drafters.py", "-k", "accepted_more")),
    Mutation("eagle-regresses-the-current-feature", "src/decodekit/speculative/trained/networks.py",
             "self._scored(predicted, features[:, 1 + step :]", "self._scored(predicted, features[:, step : step + L]",
             ("tests/test_trained_drafters.py", "-k", "accepted_more")),
    Mutation("eagle-drafts-from-the-first-new-pair", "src/decodekit/speculative/drafters/eagle.py",
             "self.ahead = out[0, -1]", "self.ahead = out[0, 0]",
             ("tests/test_trained_drafters.py", "-k", "one_by_one")),
    Mutation("eagle-children-scored-under-the-first-node", "src/decodekit/speculative/drafters/eagle.py",
             "base = root_score if parent < 0 else scores[parent]", "base = root_score if parent < 0 else scores[0]",
             ("tests/test_trained_drafters.py", "-k", "eagle2")),
    Mutation("eagle-expands-the-least-confident", "src/decodekit/speculative/drafters/eagle.py",
             "frontier = sorted(children, key=lambda i: -scores[i])[:k]", "frontier = sorted(children, key=lambda i: scores[i])[:k]",
             ("tests/test_trained_drafters.py", "-k", "eagle2")),
    Mutation("drafter-for-another-model-accepted", "src/decodekit/speculative/trained/store.py",
             'if meta["target"] != target_fingerprint(backend):', "if False:",
             ("tests/test_trained_drafters.py", "-k", "refused")),
    Mutation("benchmark-questions-not-dropped", "src/decodekit/speculative/trained/data.py",
             "if len(key.split()) < 3 or key in seen or exclusion.overlaps(query):",
             "if len(key.split()) < 3 or key in seen:", ("tests/test_trained_drafters.py", "-k", "benchmark")),
    Mutation("forced-text-of-the-wrong-position", "src/decodekit/speculative/loop.py",
             "return state.sampler.forced(state.generated)[:most]", "return state.sampler.forced(state.generated[:-1])[:most]",
             ("tests/test_constraint.py", "-k", "forced or fixes")),
    Mutation("forced-tokens-ignore-a-refused-path", "src/decodekit/samplers/constraint.py",
             "        if not self._follow(list(generated)):\n            return []\n        return list(self.matcher.compute_ff_tokens())",
             "        self._follow(list(generated))\n        return list(self.matcher.compute_ff_tokens())",
             ("tests/test_constraint.py", "-k", "forced or fixes")),
    Mutation("forced-tokens-committed-unverified", "src/decodekit/speculative/loop.py",
             "                produced = self._verify(state, DraftTree.chain(forced, source=FORCED), learn=False)",
             "                produced = forced + [forced[-1]]\n                state.backend.verify_tree(torch.tensor([state.tokens[-1], *forced[:-1]]), list(range(-1, len(forced) - 1)))\n                state.backend.commit_path(list(range(len(forced))))\n                state.commit(produced[:-1]); produced = produced[:-1]",
             ("tests/test_constraint.py", "-k", "refused_draft")),
    Mutation("constraint-masks-every-row-for-the-first", "src/decodekit/samplers/constraint.py",
             "            bits = masks[tuple(tokens)]", "            bits = masks[tuple(rows[0])]",
             ("tests/test_constraint.py", "-k", "mask_follows_each_rows_own_path")),
    Mutation("unmasked-greedy-choice-where-bytes-are-forced", "src/decodekit/samplers/constraint.py",
             "return not self.matcher.compute_ff_bytes() and self.matcher.validate_tokens([token]) == 1",
             "return self.matcher.validate_tokens([token]) == 1",
             ("tests/test_constraint.py", "-k", "unmasked")),
    Mutation("mask-computed-ahead-for-the-row-before", "src/decodekit/samplers/constraint.py",
             "(self._bitmask() if self._follow(row) else None)", "(self._bitmask() if self._follow(row[:-1]) else None)",
             ("tests/test_constraint.py", "-k", "ahead")),
    Mutation("matcher-counts-tokens-it-refused", "src/decodekit/samplers/constraint.py",
             "self.consumed.extend(rest[:taken])", "self.consumed.extend(rest)",
             ("tests/test_constraint.py", "-k", "ahead or own_path or forced")),
    Mutation("second-thread-skips-its-share-of-the-quantisation", "src/decodekit/models/kernels/gemm_q8.c",
             "quantize_vector(x, blocks * me / team, blocks * (me + 1) / team, &in);",
             "quantize_vector(x, blocks * me / team, me ? blocks * me / team : blocks * (me + 1) / team, &in);",
             ("tests/test_gguf_blocks.py", "-k", "two_threads")),
    Mutation("argmax-takes-the-last-of-equal-values", "src/decodekit/models/kernels/topk.c",
             "__mmask16 greater = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);",
             "__mmask16 greater = _mm512_cmp_ps_mask(v, lane_best, _CMP_GE_OQ);",
             ("tests/test_kernels.py", "-k", "argmax")),
    Mutation("argmax-breaks-ties-between-lanes-by-the-higher-index", "src/decodekit/models/kernels/simd.h",
             "(values[lane] == *best && where[lane] < *best_at)", "(values[lane] == *best && where[lane] > *best_at)",
             ("tests/test_kernels.py", "-k", "argmax")),
    Mutation("greedy-step-under-a-grammar-ignores-the-mask", "src/decodekit/models/kernels/token_mask.c",
             "__mmask16 greater = _mm512_mask_cmp_ps_mask(allowed, v, lane_best, _CMP_GT_OQ);",
             "__mmask16 greater = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);",
             ("tests/test_constraint.py", "-k", "greedy_step")),
    Mutation("race-filter-without-the-logarithms-bound", "src/decodekit/models/kernels/race.c",
             "__m512d bar = _mm512_fnmadd_pd(pd, _mm512_set1_pd(scale), one);",
             "__m512d bar = _mm512_fnmadd_pd(pd, _mm512_set1_pd(scale / 2), one);",
             ("tests/test_kernels.py", "-k", "race")),
    Mutation("race-bar-compared-strictly", "src/decodekit/models/kernels/race.c",
             "__mmask8 maybe = _mm512_cmp_pd_mask(uniforms(z), bar, _CMP_GE_OQ)",
             "__mmask8 maybe = _mm512_cmp_pd_mask(uniforms(z), bar, _CMP_GT_OQ)",
             ("tests/test_kernels.py", "-k", "top_cell")),
    Mutation("race-tail-bar-compared-strictly", "src/decodekit/models/kernels/race.c",
             "uniform(key, v) >= 1.0 - (double)p[v] * scale", "uniform(key, v) > 1.0 - (double)p[v] * scale",
             ("tests/test_kernels.py", "-k", "top_cell")),
    Mutation("race-tail-skips-the-check", "src/decodekit/models/kernels/race.c",
             "        if (!(p[v] >= 0.0f) || isinf(p[v])) return -1;\n        if (p[v] > 0.0f && uniform",
             "        if (p[v] > 0.0f && uniform", ("tests/test_kernels.py", "-k", "race")),
    Mutation("mask-kernel-keeps-the-refused-tokens", "src/decodekit/models/kernels/token_mask.c",
             "_mm512_mask_blend_ps((__mmask16)half_word(bits, i / 16), refused,", "_mm512_mask_blend_ps((__mmask16)~half_word(bits, i / 16), refused,", ("tests/test_kernels.py", "-k", "bitmask")),
    Mutation("hidden-state-without-the-last-layers-output", "src/decodekit/models/native.py",
             "                    if pending is not None:\n                        x.add_(pending)  # rounds as the fused add does\n                        pending = None\n                    hidden[i + 1] = x.clone()",
             "                    hidden[i + 1] = x.clone()",
             ("tests/test_backend.py", "-k", "transformers_values")),
    Mutation("rejection-sampling-accepts-10-percent-too-often-per-depth", "src/decodekit/speculative/verify.py",
             "if qx > 0 and u * qx < px:", "if qx > 0 and u * qx < 1.1 * px:",
             ("tests/test_speculative_sampling.py", "-k", "each_depth")),
    Mutation("ray-lost-workers-unit-dropped", "src/decodekit/cluster.py",
             "            pending.appendleft(key)", "            pass", ("tests/test_ray.py", "-k", "killed")),
    Mutation("ray-lost-worker-not-replaced", "src/decodekit/cluster.py",
             "            pending.appendleft(key)\n        self._start_worker()", "            pending.appendleft(key)",
             ("tests/test_ray.py", "-k", "killed")),
    Mutation("ray-payload-error-taken-for-a-lost-worker", "src/decodekit/cluster.py",
             "raise (err.cause if isinstance(err.cause, BaseException) else err) from None",
             "self._replace(actor, key, pending, err)\n            return",
             ("tests/test_ray.py", "-k", "payload")),
    Mutation("ray-bench-records-in-arrival-order", "src/decodekit/bench/distributed.py",
             "    records.sort(key=", "    sorted(records, key=", ("tests/test_ray.py", "-k", "same_schema")),
    Mutation("ray-resume-runs-finished-questions-again", "src/decodekit/bench/distributed.py",
             "if (r, q.question_id) not in done}", "}", ("tests/test_ray.py", "-k", "resume")),
    Mutation("rotary-angles-never-reached", "src/decodekit/models/native.py",
             "        for table in self._ropes:\n            table.reach(end)\n", "",
             ("tests/test_gguf_blocks.py", "-k", "rotary")),
    Mutation("head-slice-packed-at-the-top", "src/decodekit/models/llama_weights.py",
             "pack_integer_blocks(kind, part.data, n_in, into=packed, first_row=start)",
             "pack_integer_blocks(kind, part.data, n_in, into=packed, first_row=0)",
             ("tests/test_gguf_blocks.py", "-k", "fast_head")),
    Mutation("chat-template-without-special-tokens", "src/decodekit/models/tokenizer.py",
             "render_chat(self._template, chat, add_generation_prompt=True, **self._special)",
             "render_chat(self._template, chat, add_generation_prompt=True)",
             ("tests/test_tokenizer.py", "tests/test_chat_template.py")),
    Mutation("eagle-stops-a-node-early", "src/decodekit/speculative/drafters/eagle.py",
             "sum(score >= best for score in scores) < budget", "sum(score >= best for score in scores) < budget - 1",
             ("tests/test_trained_drafters.py", "-k", "eagle2")),
    Mutation("eagle-grows-every-level", "src/decodekit/speculative/drafters/eagle.py",
             "or not _can_enter(scores, scores[frontier[0]], budget):", ":",
             ("tests/test_trained_drafters.py", "-k", "stops_growing")),
    Mutation("refused-draft-kept-with-its-parent", "src/decodekit/speculative/loop.py",
             "for _ in range(len(paths[leaf]) - taken):", "for _ in range(len(paths[leaf]) - taken - 1):",
             ("tests/test_constraint.py", "-k", "dropped_before_verification")),
    Mutation("refused-drafts-dropped-under-rejection-sampling", "src/decodekit/speculative/loop.py",
             "or not isinstance(self.verifier, PathVerifier)\n", "\n",
             ("tests/test_constraint.py", "-k", "dropped_before_verification")),
    Mutation("padded-vocabulary-id-given-to-the-matcher", "src/decodekit/samplers/constraint.py",
             "self.matcher.try_consume_tokens(self._known(rest))", "self.matcher.try_consume_tokens(rest)",
             ("tests/test_constraint.py", "-k", "past_the_grammars_vocabulary")),
    Mutation("verification-processes-every-row-as-the-root", "src/decodekit/speculative/verify.py",
             "Histories([histories[row]], state.prompt_len)", "Histories([histories[0]], state.prompt_len)",
             ("tests/test_constraint.py", "-k", "speculation_under")),
    Mutation("verification-processes-every-row", "src/decodekit/speculative/verify.py",
             "    if not state.sampler.needs_history:\n        return None\n    histories",
             "    if True:\n        return None\n    histories",
             ("tests/test_constraint.py", "-k", "masks_only_the_rows")),
)


def copy_repository(to: Path) -> None:
    """The tracked and untracked (not ignored) files, as git lists them: no virtual environment,
    no caches."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for rel in listed:
        source = ROOT / rel
        if source.is_file():
            (to / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / rel)


def run(mutation: Mutation) -> str:
    with tempfile.TemporaryDirectory(prefix="decodekit-mutant-") as tmp:
        copy = Path(tmp)
        copy_repository(copy)
        target = copy / mutation.path
        text = target.read_text()
        if text.count(mutation.old) != 1:
            return "STALE"
        target.write_text(text.replace(mutation.old, mutation.new))
        # the copy's source comes first on the path, ahead of the installed (editable) package
        env = {**__import__("os").environ, "PYTHONPATH": str(copy / "src")}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests],
                                cwd=copy, env=env, capture_output=True, text=True)
        return "caught" if result.returncode != 0 else "SURVIVED"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name:48} {m.path}  ({' '.join(m.tests)})")
        return 0 if args.list else 2
    # a control: the same copy and tests without any mutation must pass, or "caught" means nothing
    control = Mutation("control", chosen[0].path, chosen[0].old, chosen[0].old, chosen[0].tests)
    if run(control) != "SURVIVED":
        print(f"the tests of {chosen[0].name} fail without any mutation: fix them first")
        return 2
    verdicts = {}
    for m in chosen:
        verdicts[m.name] = run(m)
        print(f"{verdicts[m.name]:9} {m.name}", flush=True)
    if "STALE" in verdicts.values():
        return 2
    return 1 if "SURVIVED" in verdicts.values() else 0


if __name__ == "__main__":
    sys.exit(main())
