/* Weight-streaming matrix products for decode steps: Y[m] = W X[m] for a few rows X[m].
 *
 * W is row-major [n_out, n_in]; X is [M, n_in] and Y is [M, n_out], all of one dtype (float32 or
 * bfloat16; bfloat16 results are rounded to nearest even from float32 sums). A decode step (M = 1) or a small verification pass (M <= 16 or so) reads
 * every weight once and does little arithmetic with it, so its speed is set by how fast weights
 * stream from memory. Blocks of four weight rows are read side by side (four streams keep more
 * loads in flight), each block is applied to the inputs four at a time while it sits in L1, and
 * blocks are split between threads with OpenMP (inside torch's process this is torch's own
 * OpenMP runtime).
 *
 * bfloat16 uses AVX512-BF16's dot-product instruction: exact products of bfloat16 pairs, summed
 * in float32 (the arithmetic of oneDNN's bfloat16 GEMM, in a different order).
 *
 * Q4_1 and Q8_0 weights are GGUF blocks, rebuilt in float32 in registers (see below): a decode
 * step reads 5 or 8.5 bits a weight instead of 32, with float32 results bit-identical to the
 * float32 kernel on the dequantised weights.
 *
 * Every output is summed in the same order whatever M is (vector lanes of partial sums, then
 * one horizontal sum), so a token's projections in a multi-token pass are bit-identical to
 * those of a one-token step.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Each weight format says where row r starts (P_row) and how to load the weights [i, i + lanes)
 * of a row as the vector its multiply-accumulate takes (P_at). */

/* float32: 16 lanes per vector */
#define f32_LANES 16
typedef __mmask16 f32_mask;
static inline f32_mask f32_tail(int n) { return (f32_mask)((1u << n) - 1u); }
static inline __m512 f32_load(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 f32_load_masked(const float *p, f32_mask m) { return _mm512_maskz_loadu_ps(m, p); }
static inline const float *f32_row(const float *w, int r, int n_in) { return w + (size_t)r * n_in; }
static inline __m512 f32_at(const float *row, int i) { return f32_load(row + i); }
static inline __m512 f32_at_masked(const float *row, int i, f32_mask m) { return f32_load_masked(row + i, m); }
static inline __m512 f32_mac(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
static inline float f32_out(float s) { return s; }

/* bfloat16: 32 values per vector, pairs multiplied and added into 16 float32 lanes */
#define bf16_LANES 32
typedef __mmask32 bf16_mask;
static inline bf16_mask bf16_tail(int n) { return (bf16_mask)((1ull << n) - 1ull); }
static inline __m512i bf16_load(const uint16_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline __m512i bf16_load_masked(const uint16_t *p, bf16_mask m) { return _mm512_maskz_loadu_epi16(m, p); }
static inline const uint16_t *bf16_row(const uint16_t *w, int r, int n_in) { return w + (size_t)r * n_in; }
static inline __m512i bf16_at(const uint16_t *row, int i) { return bf16_load(row + i); }
static inline __m512i bf16_at_masked(const uint16_t *row, int i, bf16_mask m) { return bf16_load_masked(row + i, m); }
static inline __m512 bf16_mac(__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
/* float32 -> bfloat16, round to nearest even (torch's conversion; NaN stays NaN) */
static inline uint16_t bf16_out(float s) {
    union { float f; uint32_t u; } v = {s};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* GGUF blocks of 32 weights, rebuilt in float32 exactly as GGUF dequantisation computes them
 * (gguf-py, ggml): Q4_1 {fp16 d, fp16 m, 16 bytes: weight j in the low nibble of byte j, weight
 * j + 16 in the high nibble} -> d * q + m; Q8_0 {fp16 d, int8 q[32]} -> d * q. d * q is exact in
 * float32 (an 11-bit by 4- or 8-bit product), so one fused multiply-add gives the dequantised
 * float32 weight bit for bit, and the float32 kernel's sums follow. Rows are n_in / 32 blocks;
 * n_in is a multiple of 32, so the masked loads are never needed. */
static inline float half_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

static inline const uint8_t *q4_1_row(const uint8_t *w, int r, int n_in) { return w + (size_t)r * (n_in / 32) * 20; }
static inline __m512 q4_1_at(const uint8_t *row, int i) {
    const uint8_t *block = row + (size_t)(i / 32) * 20;
    __m128i qs = _mm_loadu_si128((const __m128i *)(block + 4));
    if (i & 16) qs = _mm_srli_epi16(qs, 4);
    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, _mm_set1_epi8(0x0f))));
    return _mm512_fmadd_ps(q, _mm512_set1_ps(half_at(block)), _mm512_set1_ps(half_at(block + 2)));
}
static inline __m512 q4_1_at_masked(const uint8_t *row, int i, f32_mask m) { return _mm512_maskz_mov_ps(m, q4_1_at(row, i)); }

static inline const uint8_t *q8_0_row(const uint8_t *w, int r, int n_in) { return w + (size_t)r * (n_in / 32) * 34; }
static inline __m512 q8_0_at(const uint8_t *row, int i) {
    const uint8_t *block = row + (size_t)(i / 32) * 34;
    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 2 + (i & 16)))));
    return _mm512_mul_ps(q, _mm512_set1_ps(half_at(block)));
}
static inline __m512 q8_0_at_masked(const uint8_t *row, int i, f32_mask m) { return _mm512_maskz_mov_ps(m, q8_0_at(row, i)); }

/* NAME: weights of type WT in format WP, inputs and outputs of type T with arithmetic P. */
#define DEFINE_KERNEL(NAME, WT, WP, T, VEC, P, OUT)                                                \
    static inline __attribute__((always_inline)) void NAME##_block(                               \
        const WT *w, const T *x, OUT *y, int n_in, int n_out, const int R, const int M) {          \
        __m512 acc[4][4];                                                                          \
        VEC wv[4];                                                                                 \
        const WT *rows[4];                                                                         \
        for (int r = 0; r < R; r++) rows[r] = WP##_row(w, r, n_in);                                \
        for (int r = 0; r < R; r++)                                                                \
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();                           \
        int i = 0;                                                                                 \
        for (; i + P##_LANES <= n_in; i += P##_LANES) {                                            \
            for (int r = 0; r < R; r++) wv[r] = WP##_at(rows[r], i);                               \
            for (int m = 0; m < M; m++) {                                                          \
                VEC xv = P##_load(x + (size_t)m * n_in + i);                                       \
                for (int r = 0; r < R; r++) acc[r][m] = P##_mac(acc[r][m], wv[r], xv);             \
            }                                                                                      \
        }                                                                                          \
        if (i < n_in) { /* the last partial vector: masked loads (zeros add nothing) */            \
            P##_mask mask = P##_tail(n_in - i);                                                    \
            for (int r = 0; r < R; r++) wv[r] = WP##_at_masked(rows[r], i, mask);                  \
            for (int m = 0; m < M; m++) {                                                          \
                VEC xv = P##_load_masked(x + (size_t)m * n_in + i, mask);                          \
                for (int r = 0; r < R; r++) acc[r][m] = P##_mac(acc[r][m], wv[r], xv);             \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int m = 0; m < M; m++) y[(size_t)m * n_out + r] = P##_out(_mm512_reduce_add_ps(acc[r][m])); \
    }                                                                                              \
                                                                                                   \
    /* Rows [row, row + R) of W (R = 4, or 1 for the last rows) against all M inputs. */           \
    static void NAME##_rows(const WT *w, const T *x, OUT *y, int n_in, int n_out, int row, int R, int M) { \
        const WT *wr = WP##_row(w, row, n_in);                                                     \
        for (int m0 = 0; m0 < M; m0 += 4) {                                                        \
            const T *xm = x + (size_t)m0 * n_in;                                                   \
            OUT *ym = y + (size_t)m0 * n_out + row;                                                \
            int left = M - m0 < 4 ? M - m0 : 4;                                                    \
            if (R == 4) {                                                                          \
                switch (left) {                                                                    \
                    case 1: NAME##_block(wr, xm, ym, n_in, n_out, 4, 1); break;                    \
                    case 2: NAME##_block(wr, xm, ym, n_in, n_out, 4, 2); break;                    \
                    case 3: NAME##_block(wr, xm, ym, n_in, n_out, 4, 3); break;                    \
                    default: NAME##_block(wr, xm, ym, n_in, n_out, 4, 4); break;                   \
                }                                                                                  \
            } else {                                                                               \
                for (int m = 0; m < left; m++)                                                     \
                    NAME##_block(wr, xm + (size_t)m * n_in, ym + (size_t)m * n_out, n_in, n_out, 1, 1); \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void NAME(const WT *w, const T *x, OUT *y, int M, int n_out, int n_in, int threads) {          \
        int blocks = n_out / 4;                                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")         \
        for (int b = 0; b < blocks; b++) NAME##_rows(w, x, y, n_in, n_out, 4 * b, 4, M);           \
        for (int r = 4 * blocks; r < n_out; r++) NAME##_rows(w, x, y, n_in, n_out, r, 1, M);       \
    }

DEFINE_KERNEL(decodekit_gemm_f32, float, f32, float, __m512, f32, float)
DEFINE_KERNEL(decodekit_gemm_bf16, uint16_t, bf16, uint16_t, __m512i, bf16, uint16_t)
DEFINE_KERNEL(decodekit_gemm_q4_1, uint8_t, q4_1, float, __m512, f32, float)
DEFINE_KERNEL(decodekit_gemm_q8_0, uint8_t, q8_0, float, __m512, f32, float)

/* Whether this CPU runs the bfloat16 kernel (the float32 one needs only AVX-512F). */
int decodekit_has_avx512bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}
