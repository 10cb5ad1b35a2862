/* Attention for decode steps and small verification passes, computed so that a query's result
 * depends only on the keys it sees, in order: not on how many other queries share the pass,
 * nor on where masked keys sit in the cache.
 *
 * For each (head, query): scores s_j = scale * q.k_j over the visible keys j in cache order
 * (each a fixed-order 16-lane dot product), their max, p_j = exp(s_j - max) (a vectorised
 * exponential), the sum of p_j with the t-th visible key in lane t % 16, and out = (sum_j p_j v_j)
 * / sum with v accumulated one key at a time across the head dimension. A token verified in a tree (prefix + its ancestors visible) thus
 * gets bit for bit the attention output it gets in plain one-token decoding, where the same keys
 * are the contiguous cache prefix. Library attention kernels block the key axis by position,
 * so their rounding depends on the layout; with bfloat16 that flips near-tied tokens.
 *
 * q: [n_q, H, D] float32. k, v: cache of one layer and batch row, [H_kv, cap, D] in float32 or
 * bfloat16. visible: [n_q, n_keys] bytes, or NULL for "all n_keys". out: [n_q, H, D] float32.
 * Needs D % 16 == 0 and D <= 256.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

/* Replace scores[t] by exp(scores[t] - best) and return their sum. The t-th visible key always
 * lands in lane t % 16, so the sum depends only on the sequence of visible scores. */
static float softmax_numerators(float *scores, int n, float best) {
    __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(best);
    for (int t = 0; t < n; t += 16) {
        __mmask16 m = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u);
        __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), shift));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(scores + t, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

#define DEFINE_ATTENTION(NAME, T, LOAD)                                                            \
    void NAME(const float *q, const T *k, const T *v, const uint8_t *visible, float *out,           \
              int n_q, int n_heads, int n_kv_heads, int head_dim, int cap, int n_keys,              \
              float scale, int threads) {                                                          \
        int group = n_heads / n_kv_heads, chunks = head_dim / 16;                                  \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)")                              \
        {                                                                                          \
            float *scores = malloc(sizeof(float) * (size_t)n_keys);                                \
            int *keys = malloc(sizeof(int) * (size_t)n_keys);                                      \
            _Pragma("omp for schedule(static)")                                                    \
            for (int job = 0; job < n_q * n_heads; job++) {                                        \
                int i = job / n_heads, h = job % n_heads;                                          \
                const float *qi = q + ((size_t)i * n_heads + h) * head_dim;                        \
                const T *kh = k + (size_t)(h / group) * cap * head_dim;                            \
                const T *vh = v + (size_t)(h / group) * cap * head_dim;                            \
                const uint8_t *vis = visible ? visible + (size_t)i * n_keys : NULL;                \
                __m512 qv[16];                                                                     \
                for (int c = 0; c < chunks; c++) qv[c] = _mm512_loadu_ps(qi + 16 * c);             \
                int n = 0;                                                                         \
                float best = -INFINITY;                                                            \
                for (int j = 0; j < n_keys; j++) {                                                 \
                    if (vis && !vis[j]) continue;                                                  \
                    const T *kj = kh + (size_t)j * head_dim;                                       \
                    __m512 acc = _mm512_mul_ps(qv[0], LOAD(kj));                                   \
                    for (int c = 1; c < chunks; c++) acc = _mm512_fmadd_ps(qv[c], LOAD(kj + 16 * c), acc); \
                    float s = _mm512_reduce_add_ps(acc) * scale;                                   \
                    scores[n] = s;                                                                 \
                    keys[n++] = j;                                                                 \
                    if (s > best) best = s;                                                        \
                }                                                                                  \
                float total = softmax_numerators(scores, n, best);                                 \
                __m512 o[16];                                                                      \
                for (int c = 0; c < chunks; c++) o[c] = _mm512_setzero_ps();                       \
                for (int t = 0; t < n; t++) {                                                      \
                    __m512 pv = _mm512_set1_ps(scores[t]);                                         \
                    const T *vj = vh + (size_t)keys[t] * head_dim;                                 \
                    for (int c = 0; c < chunks; c++) o[c] = _mm512_fmadd_ps(pv, LOAD(vj + 16 * c), o[c]); \
                }                                                                                  \
                float *oi = out + ((size_t)i * n_heads + h) * head_dim;                            \
                __m512 inv = _mm512_set1_ps(n ? 1.0f / total : 0.0f);                              \
                for (int c = 0; c < chunks; c++) _mm512_storeu_ps(oi + 16 * c, _mm512_mul_ps(o[c], inv)); \
            }                                                                                      \
            free(scores);                                                                          \
            free(keys);                                                                            \
        }                                                                                          \
    }

DEFINE_ATTENTION(decodekit_attention_f32, float, load_f32)
DEFINE_ATTENTION(decodekit_attention_bf16, uint16_t, load_bf16)
