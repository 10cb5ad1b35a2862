/* Seeded sampling by an exponential race, without drawing noise for every token.
 *
 * The token at a position is argmax_v p(v) / E(v), E(v) = -log U(v) ~ Exp(1) i.i.d., which is
 * exactly p-distributed (the Gumbel-max trick). U(v) depends only on a 64-bit key (the request's
 * seed and the position) and v: h, the SplitMix64 finaliser of key + (v + 1) * golden, gives
 * U = (2 (h >> 12) + 1) 2^-53, the midpoints of a grid of 2^52 cells of (0, 1): never 0 or 1, so
 * E is finite and positive, and exactly representable in a double. Drawing and taking the logarithm of 49152 uniforms is
 * most of a sampled step's cost; here the logarithm is taken for the few tokens that can win.
 * One pass, in index order, keeps the best ratio so far; a token can beat it only if
 * E(v) < p(v) / best, and since -log u >= 1 - u, only if U(v) > 1 - p(v) / best: a multiply and a
 * compare per token. The bar is lowered by a relative margin of 1e-6, which covers the rounding of
 * the logarithm and the divisions, and compared with >=, since rounding 1 - p margin / best can
 * land on U itself (when p / best is below the spacing of doubles near 1). Only tokens that pass get E(v) = -log U(v) and p(v) / E(v), in double
 * precision with libm's log. For a normalised p about ln(V) tokens pass when p is flat (a token
 * passes with probability p(v) / best, and the best of the first k grows like k), fewer when it
 * is peaked.
 *
 * The answer is the argmax over every token whatever the filter lets through (the first index
 * among equal ratios): decodekit/models/kernels/sampling.py computes the same with numpy and
 * math.log where this library is not available. p(v) = 0 never wins. Returns -1 when p has a
 * negative, infinite or NaN entry or no positive one. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "decodekit.h"

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define MARGIN (1.0 + 1e-6)

static inline uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline double uniform(uint64_t key, int64_t v) {
    return (double)(((mix(key + (uint64_t)(v + 1) * GOLDEN) >> 12) << 1) | 1) * 0x1p-53;
}

static inline double ratio(float p, double u) { return (double)p / -log(u); }

double decodekit_race_uniform(uint64_t key, int64_t v) { return uniform(key, v); }

/* U for the eight tokens whose SplitMix64 inputs are z (race.c's uniform(), eight lanes). */
static inline __m512d uniforms(__m512i z) {
    __m512i h = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
    h = _mm512_mullo_epi64(h, _mm512_set1_epi64((long long)0xBF58476D1CE4E5B9ULL));
    h = _mm512_xor_si512(h, _mm512_srli_epi64(h, 27));
    h = _mm512_mullo_epi64(h, _mm512_set1_epi64((long long)0x94D049BB133111EBULL));
    h = _mm512_xor_si512(h, _mm512_srli_epi64(h, 31));
    __m512i odd = _mm512_or_si512(_mm512_slli_epi64(_mm512_srli_epi64(h, 12), 1), _mm512_set1_epi64(1));
    return _mm512_mul_pd(_mm512_cvtepu64_pd(odd), _mm512_set1_pd(0x1p-53));
}

static inline __m512i first_inputs(uint64_t key) {
    return _mm512_add_epi64(_mm512_set1_epi64((long long)key),
                            _mm512_mullo_epi64(_mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8), _mm512_set1_epi64((long long)GOLDEN)));
}

/* Whether token v, with ratio r, takes the lead; the bar for the next tokens follows. */
static inline void consider(int64_t v, double r, double *best, int64_t *best_at, double *scale) {
    if (r > *best) {  /* tokens come in index order: an equal ratio keeps the first */
        *best = r;
        *best_at = v;
        *scale = MARGIN / r;
    }
}

int64_t decodekit_race_f32(const float *p, int64_t n, uint64_t key) {
    const __m512i eight_golden = _mm512_set1_epi64((long long)(8 * GOLDEN));
    const __m512d one = _mm512_set1_pd(1.0), zero = _mm512_setzero_pd(), inf = _mm512_set1_pd(INFINITY);
    double best = 0.0, scale = INFINITY;  /* no leader yet: every positive token passes */
    int64_t best_at = -1;
    __mmask8 bad = 0;
    __m512i z = first_inputs(key);
    int64_t v = 0;
    for (; v + 8 <= n; v += 8, z = _mm512_add_epi64(z, eight_golden)) {
        __m512d pd = _mm512_cvtps_pd(_mm256_loadu_ps(p + v));
        bad |= _mm512_cmp_pd_mask(pd, zero, _CMP_NGE_UQ) | _mm512_cmp_pd_mask(pd, inf, _CMP_EQ_OQ);  /* < 0, NaN, inf */
        __m512d bar = _mm512_fnmadd_pd(pd, _mm512_set1_pd(scale), one);  /* 1 - p margin / best */
        __mmask8 maybe = _mm512_cmp_pd_mask(uniforms(z), bar, _CMP_GE_OQ) & _mm512_cmp_pd_mask(pd, zero, _CMP_GT_OQ);
        while (maybe) {
            int lane = __builtin_ctz(maybe);
            maybe &= maybe - 1;
            consider(v + lane, ratio(p[v + lane], uniform(key, v + lane)), &best, &best_at, &scale);
        }
    }
    for (; v < n; v++) {
        if (!(p[v] >= 0.0f) || isinf(p[v])) return -1;
        if (p[v] > 0.0f && uniform(key, v) >= 1.0 - (double)p[v] * scale)
            consider(v, ratio(p[v], uniform(key, v)), &best, &best_at, &scale);
    }
    return bad || best_at < 0 ? -1 : best_at;
}

/* Whether this CPU has the 64-bit multiplies and conversions (AVX512DQ) the race uses. */
int decodekit_has_avx512dq(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512dq");
}
