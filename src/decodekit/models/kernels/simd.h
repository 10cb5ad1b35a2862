/* AVX-512 helpers shared by the kernels: bfloat16 loads and stores, and a vectorised exponential.
 * Every lane computes the same function of its own input, so results never depend on which
 * lane (or which neighbours) a value has. Built for AVX2 (no __AVX512F__), the AVX-512 intrinsics
 * are those of avx512_on_avx2.h, lane for lane the same. */
#ifndef DECODEKIT_SIMD_H
#define DECODEKIT_SIMD_H
#include <immintrin.h>
#ifndef __AVX512F__
#include "avx512_on_avx2.h"
#endif
#include <stddef.h>
#include <stdint.h>

static inline __m512 load_f32(const float *p) { return _mm512_loadu_ps(p); }

/* Subnormal inputs and results read and written as zero (MXCSR's DAZ and FTZ), on the calling
 * thread: what torch.set_flush_denormal sets, set again by every thread at the start of every
 * parallel region, because the setting is per thread and a team made before the model was loaded
 * (or by a thread made before) lacks it. Otherwise a row's bits could depend on which thread of a
 * team computed it, and subnormal arithmetic is many times slower. */
static inline void flush_denormals(void) { _mm_setcsr(_mm_getcsr() | 0x8040); }

/* Ask the memory for the `bytes` from p on, a cache line at a time (a prefetch: a hint, never a
 * load, so a pointer past the data is harmless): a stream's next data a little ahead of its use, where
 * the hardware prefetchers alone leave the loads waiting (an Intel Xeon's; docs/BENCHMARKS.md). */
static inline __attribute__((always_inline)) void ask_for(const void *p, size_t bytes) {
    for (size_t at = 0; at < bytes; at += 64) _mm_prefetch((const char *)p + at, _MM_HINT_T0);
}

/* The same into the second-level cache only: data wanted after the next few thousand cycles. */
static inline __attribute__((always_inline)) void ask_for_later(const void *p, size_t bytes) {
    for (size_t at = 0; at < bytes; at += 64) _mm_prefetch((const char *)p + at, _MM_HINT_T1);
}

/* 16 bfloat16 values widened to float32 (exact). */
static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* float32 -> bfloat16 rounded to nearest even, as torch converts (NaN stays a quiet NaN).
 * Plain AVX-512F integer arithmetic, so it runs where AVX512-BF16 is missing. */
static inline __m256i round_to_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(rounded);
}
static inline void store_bf16(uint16_t *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, round_to_bf16(x)); }

/* The value a bfloat16 store then load would give: x rounded to bfloat16, in float32. */
static inline __m512 as_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_to_bf16(x)), 16));
}

/* exp(x), 16 lanes: x = n ln2 + r, exp(r) by its degree-7 Taylor polynomial (relative error
 * ~1e-7 on |r| <= ln2/2), times 2^n. Inputs below -87 give exp(-87); above ~88, infinity. */
static inline __m512 vexp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);     /* ln2, high part */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);          /* ln2, low part */
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The largest of 16 lanes' values and where it was, the lowest index among equals: the last step
 * of an argmax whose lanes each kept their first maximum (topk.c, token_mask.c). */
static inline void largest_lane(__m512 lane_best, __m512i lane_at, float *best, int64_t *best_at) {
    float values[16];
    int32_t where[16];
    _mm512_storeu_ps(values, lane_best);
    _mm512_storeu_si512(where, lane_at);
    *best = values[0];
    *best_at = where[0];
    for (int lane = 1; lane < 16; lane++) {
        if (values[lane] > *best || (values[lane] == *best && where[lane] < *best_at)) {
            *best = values[lane];
            *best_at = where[lane];
        }
    }
}

#endif
