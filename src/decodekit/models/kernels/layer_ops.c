/* The element-wise parts of a transformer layer for decode steps and small verification passes,
 * one call each where torch needs a handful of ops (and a few microseconds of dispatch apiece,
 * which adds up to several percent of a decode step):
 *
 *   add_rms_norm  x += delta (in place, in x's dtype), then h = rms_norm(x) * weight
 *   silu_mul      out = silu(gate) * up, from the fused [gate | up] projection
 *   gelu_mul      out = gelu_tanh(gate) * up (Gemma)
 *   rope_store    rotate the q and k heads of the fused qkv projection (adjacent pairs, one
 *                 complex multiply each), write q as float32 for the attention kernel and k, v
 *                 into the cache
 *
 * Rounding follows the torch code they replace: in bfloat16, each op's result is rounded to
 * bfloat16 (x + delta, the normalised x, its product with the weight, silu, the product with
 * up, the rotated q and k). Each row is computed alone in a fixed order, so a token's values do
 * not depend on the other rows of the pass. Needs the hidden, intermediate and head sizes to be
 * multiples of 16 (the head size only for rope_store).
 *
 * rope_store_q8 writes the int8 cache instead (kv cache "int8"): see its comment below.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "decodekit.h"
#include "simd.h"

static inline __m512 same_f32(__m512 x) { return x; }
static inline void store_f32(float *p, __m512 x) { _mm512_storeu_ps(p, x); }

#define DEFINE_LAYER_OPS(SUFFIX, T, LOAD, STORE, ROUND)                                            \
    void decodekit_add_rms_norm_##SUFFIX(T *x, const T *delta, const T *weight, T *h, int rows,    \
                                         int dim, float eps) {                                     \
        for (int r = 0; r < rows; r++) {                                                           \
            T *xr = x + (size_t)r * dim;                                                           \
            T *hr = h + (size_t)r * dim;                                                           \
            __m512 squares = _mm512_setzero_ps();                                                  \
            for (int j = 0; j < dim; j += 16) {                                                    \
                __m512 xv = LOAD(xr + j);                                                          \
                if (delta) {                                                                       \
                    xv = ROUND(_mm512_add_ps(xv, LOAD(delta + (size_t)r * dim + j)));              \
                    STORE(xr + j, xv);                                                             \
                }                                                                                  \
                squares = _mm512_fmadd_ps(xv, xv, squares);                                        \
            }                                                                                      \
            __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / dim + eps));  \
            for (int j = 0; j < dim; j += 16) {                                                    \
                __m512 normed = ROUND(_mm512_mul_ps(LOAD(xr + j), inv));                           \
                STORE(hr + j, _mm512_mul_ps(normed, LOAD(weight + j)));                            \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void decodekit_silu_mul_##SUFFIX(const T *gate_up, T *out, int rows, int inter) {              \
        for (int r = 0; r < rows; r++) {                                                           \
            const T *gate = gate_up + (size_t)r * 2 * inter, *up = gate + inter;                   \
            for (int j = 0; j < inter; j += 16) {                                                  \
                __m512 g = LOAD(gate + j);                                                         \
                __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), vexp(_mm512_sub_ps(_mm512_setzero_ps(), g))); \
                __m512 silu = ROUND(_mm512_div_ps(g, denominator));                                \
                STORE(out + (size_t)r * inter + j, _mm512_mul_ps(silu, LOAD(up + j)));             \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* GeLU with the tanh approximation: 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi)  \
     * (g + 0.044715 g^3), then times up (Gemma's MLP gating). */                                 \
    void decodekit_gelu_mul_##SUFFIX(const T *gate_up, T *out, int rows, int inter) {              \
        const __m512 c = _mm512_set1_ps(-2.0f * 0.7978845608028654f), cube = _mm512_set1_ps(0.044715f); \
        for (int r = 0; r < rows; r++) {                                                           \
            const T *gate = gate_up + (size_t)r * 2 * inter, *up = gate + inter;                   \
            for (int j = 0; j < inter; j += 16) {                                                  \
                __m512 g = LOAD(gate + j);                                                         \
                __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(cube, g), _mm512_mul_ps(g, g), g);    \
                __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), vexp(_mm512_mul_ps(c, inner))); \
                __m512 gelu = ROUND(_mm512_div_ps(g, denominator));                                \
                STORE(out + (size_t)r * inter + j, _mm512_mul_ps(gelu, LOAD(up + j)));             \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void decodekit_rope_store_##SUFFIX(const T *qkv, const float *freqs, const int64_t *positions, \
                                       float *q_out, T *k_cache, T *v_cache, int rows,             \
                                       int n_heads, int n_kv_heads, int head_dim, int cap,         \
                                       int start) {                                                \
        int width = (n_heads + 2 * n_kv_heads) * head_dim;                                         \
        for (int r = 0; r < rows; r++) {                                                           \
            const T *row = qkv + (size_t)r * width;                                                \
            const float *f = freqs + (size_t)positions[r] * head_dim; /* (cos, sin) pairs */       \
            size_t slot = (size_t)(start + r) * head_dim;                                          \
            for (int head = 0; head < n_heads + n_kv_heads; head++) {                              \
                for (int j = 0; j < head_dim; j += 16) {                                           \
                    __m512 x = LOAD(row + (size_t)head * head_dim + j), fv = _mm512_loadu_ps(f + j); \
                    /* (a + ib)(c + is): even lanes a c - b s, odd lanes b c + a s */              \
                    __m512 swapped_sin = _mm512_mul_ps(_mm512_permute_ps(x, 0xB1), _mm512_movehdup_ps(fv)); \
                    __m512 rotated = ROUND(_mm512_fmaddsub_ps(x, _mm512_moveldup_ps(fv), swapped_sin)); \
                    if (head < n_heads)                                                            \
                        _mm512_storeu_ps(q_out + ((size_t)r * n_heads + head) * head_dim + j, rotated); \
                    else                                                                           \
                        STORE(k_cache + (size_t)(head - n_heads) * cap * head_dim + slot + j, rotated); \
                }                                                                                  \
            }                                                                                      \
            for (int kv = 0; kv < n_kv_heads; kv++)                                                \
                memcpy(v_cache + (size_t)kv * cap * head_dim + slot,                               \
                       row + (size_t)(n_heads + n_kv_heads + kv) * head_dim, sizeof(T) * head_dim);\
        }                                                                                          \
    }

DEFINE_LAYER_OPS(f32, float, load_f32, store_f32, same_f32)
DEFINE_LAYER_OPS(bf16, uint16_t, load_bf16, store_bf16, as_bf16)

/* rope_store for the int8 cache (kv cache "int8", float32 models): as decodekit_rope_store_f32,
 * then each (row, key/value head)'s rotated key and its value are quantised alone: scale
 * max|x| / 127, q = x / scale rounded to nearest even, stored as head_dim int8 then the float32
 * scale (row bytes head_dim + 4, slot start + r of a [n_kv_heads, cap] cache). */
static void quantise_row(const float *x, int8_t *dst, int n) {
    __m512 amax = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    float scale = _mm512_reduce_max_ps(amax) / 127.0f;
    float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    /* a row below ~3.7e-37 has an infinite inverse: stored as zeros (as quantise_int8_rows does) */
    __m512 inverse = _mm512_set1_ps(isinf(inv) ? 0.0f : inv);
    for (int j = 0; j < n; j += 16)
        _mm_storeu_si128((__m128i *)(dst + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), inverse))));
    memcpy(dst + n, &scale, sizeof(float));
}

void decodekit_rope_store_q8(const float *qkv, const float *freqs, const int64_t *positions, float *q_out,
                             int8_t *k_cache, int8_t *v_cache, int rows, int n_heads, int n_kv_heads, int head_dim,
                             int cap, int start) {
    int width = (n_heads + 2 * n_kv_heads) * head_dim;
    size_t row_bytes = (size_t)head_dim + 4;
    float rotated[256];
    for (int r = 0; r < rows; r++) {
        const float *row = qkv + (size_t)r * width;
        const float *f = freqs + (size_t)positions[r] * head_dim;
        for (int head = 0; head < n_heads + n_kv_heads; head++) {
            float *dst = head < n_heads ? q_out + ((size_t)r * n_heads + head) * head_dim : rotated;
            for (int j = 0; j < head_dim; j += 16) {
                __m512 x = _mm512_loadu_ps(row + (size_t)head * head_dim + j), fv = _mm512_loadu_ps(f + j);
                __m512 swapped_sin = _mm512_mul_ps(_mm512_permute_ps(x, 0xB1), _mm512_movehdup_ps(fv));
                _mm512_storeu_ps(dst + j, _mm512_fmaddsub_ps(x, _mm512_moveldup_ps(fv), swapped_sin));
            }
            if (head >= n_heads)
                quantise_row(rotated, k_cache + ((size_t)(head - n_heads) * cap + start + r) * row_bytes, head_dim);
        }
        for (int kv = 0; kv < n_kv_heads; kv++)
            quantise_row(row + (size_t)(n_heads + n_kv_heads + kv) * head_dim,
                         v_cache + ((size_t)kv * cap + start + r) * row_bytes, head_dim);
    }
}
