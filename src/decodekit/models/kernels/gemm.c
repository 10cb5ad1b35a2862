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
 * Every output is summed in the same order whatever M is (vector lanes of partial sums, then
 * one horizontal sum), so a token's projections in a multi-token pass are bit-identical to
 * those of a one-token step.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* float32: 16 lanes per vector */
#define f32_LANES 16
typedef __mmask16 f32_mask;
static inline f32_mask f32_tail(int n) { return (f32_mask)((1u << n) - 1u); }
static inline __m512 f32_load(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 f32_load_masked(const float *p, f32_mask m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 f32_mac(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
static inline float f32_out(float s) { return s; }

/* bfloat16: 32 values per vector, pairs multiplied and added into 16 float32 lanes */
#define bf16_LANES 32
typedef __mmask32 bf16_mask;
static inline bf16_mask bf16_tail(int n) { return (bf16_mask)((1ull << n) - 1ull); }
static inline __m512i bf16_load(const uint16_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline __m512i bf16_load_masked(const uint16_t *p, bf16_mask m) { return _mm512_maskz_loadu_epi16(m, p); }
static inline __m512 bf16_mac(__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
/* float32 -> bfloat16, round to nearest even (torch's conversion; NaN stays NaN) */
static inline uint16_t bf16_out(float s) {
    union { float f; uint32_t u; } v = {s};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#define DEFINE_KERNEL(NAME, T, VEC, P, OUT)                                                             \
    static inline __attribute__((always_inline)) void NAME##_block(                               \
        const T *w, const T *x, OUT *y, int n_in, int n_out, const int R, const int M) {           \
        __m512 acc[4][4];                                                                          \
        VEC wv[4];                                                                                 \
        for (int r = 0; r < R; r++)                                                                \
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();                           \
        int i = 0;                                                                                 \
        for (; i + P##_LANES <= n_in; i += P##_LANES) {                                            \
            for (int r = 0; r < R; r++) wv[r] = P##_load(w + (size_t)r * n_in + i);                \
            for (int m = 0; m < M; m++) {                                                          \
                VEC xv = P##_load(x + (size_t)m * n_in + i);                                       \
                for (int r = 0; r < R; r++) acc[r][m] = P##_mac(acc[r][m], wv[r], xv);             \
            }                                                                                      \
        }                                                                                          \
        if (i < n_in) { /* the last partial vector: masked loads (zeros add nothing) */            \
            P##_mask mask = P##_tail(n_in - i);                                                    \
            for (int r = 0; r < R; r++) wv[r] = P##_load_masked(w + (size_t)r * n_in + i, mask);   \
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
    static void NAME##_rows(const T *w, const T *x, OUT *y, int n_in, int n_out, int row, int R, int M) { \
        const T *wr = w + (size_t)row * n_in;                                                      \
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
    void NAME(const T *w, const T *x, OUT *y, int M, int n_out, int n_in, int threads) {         \
        int blocks = n_out / 4;                                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")         \
        for (int b = 0; b < blocks; b++) NAME##_rows(w, x, y, n_in, n_out, 4 * b, 4, M);           \
        for (int r = 4 * blocks; r < n_out; r++) NAME##_rows(w, x, y, n_in, n_out, r, 1, M);       \
    }

DEFINE_KERNEL(decodekit_gemm_f32, float, __m512, f32, float)
DEFINE_KERNEL(decodekit_gemm_bf16, uint16_t, __m512i, bf16, uint16_t)

/* Whether this CPU runs the bfloat16 kernel (the float32 one needs only AVX-512F). */
int decodekit_has_avx512bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}
