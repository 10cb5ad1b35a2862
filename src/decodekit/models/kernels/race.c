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

#ifdef __AVX512DQ__
/* Eight tokens at a time (AVX-512: 64-bit multiplies and conversions of AVX512DQ). */
#define LANES 8
typedef __m512i lanes_u64;
typedef __m512d lanes_f64;
static inline lanes_u64 u64_set1(uint64_t x) { return _mm512_set1_epi64((long long)x); }
static inline lanes_u64 u64_add(lanes_u64 a, lanes_u64 b) { return _mm512_add_epi64(a, b); }
static inline lanes_u64 u64_mul(lanes_u64 a, lanes_u64 b) { return _mm512_mullo_epi64(a, b); }
static inline lanes_u64 xor_shifted(lanes_u64 z, int n) { return _mm512_xor_si512(z, _mm512_srli_epi64(z, n)); }
static inline lanes_u64 u64_lanes(void) { return _mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8); }
/* (2 (h >> 12) + 1) 2^-53 */
static inline lanes_f64 grid_midpoint(lanes_u64 h) {
    __m512i odd = _mm512_or_si512(_mm512_slli_epi64(_mm512_srli_epi64(h, 12), 1), _mm512_set1_epi64(1));
    return _mm512_mul_pd(_mm512_cvtepu64_pd(odd), _mm512_set1_pd(0x1p-53));
}
static inline lanes_f64 f64_load(const float *p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
static inline lanes_f64 f64_set1(double x) { return _mm512_set1_pd(x); }
static inline lanes_f64 f64_fnmadd(lanes_f64 a, lanes_f64 b, lanes_f64 c) { return _mm512_fnmadd_pd(a, b, c); }
#define F64_LANES_WHERE(a, b, predicate) ((unsigned)_mm512_cmp_pd_mask(a, b, predicate))
#else
/* Four tokens at a time (AVX2): the 64-bit multiply from three 32-bit ones, and the conversion of
 * an integer below 2^53 from its two halves, each exact. The filter only decides which tokens get
 * their logarithm; the answer is the argmax either way. */
#define LANES 4
typedef __m256i lanes_u64;
typedef __m256d lanes_f64;
static inline lanes_u64 u64_set1(uint64_t x) { return _mm256_set1_epi64x((long long)x); }
static inline lanes_u64 u64_add(lanes_u64 a, lanes_u64 b) { return _mm256_add_epi64(a, b); }
static inline lanes_u64 u64_mul(lanes_u64 a, lanes_u64 b) { /* the low 64 bits of a b */
    __m256i low = _mm256_mul_epu32(a, b);
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b), _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
    return _mm256_add_epi64(low, _mm256_slli_epi64(cross, 32));
}
static inline lanes_u64 xor_shifted(lanes_u64 z, int n) { return _mm256_xor_si256(z, _mm256_srli_epi64(z, n)); }
static inline lanes_u64 u64_lanes(void) { return _mm256_setr_epi64x(1, 2, 3, 4); }
static inline lanes_f64 grid_midpoint(lanes_u64 h) {
    __m256i odd = _mm256_or_si256(_mm256_slli_epi64(_mm256_srli_epi64(h, 12), 1), _mm256_set1_epi64x(1));
    /* odd < 2^53: high half (< 2^21) and low half (< 2^32), each made a double by the 2^52 trick */
    const __m256d two52 = _mm256_set1_pd(0x1p52);
    __m256d high = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(_mm256_srli_epi64(odd, 32), _mm256_castpd_si256(two52))), two52);
    __m256d low = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(_mm256_and_si256(odd, _mm256_set1_epi64x(0xffffffff)),
                                                                     _mm256_castpd_si256(two52))), two52);
    return _mm256_mul_pd(_mm256_fmadd_pd(high, _mm256_set1_pd(0x1p32), low), _mm256_set1_pd(0x1p-53));
}
static inline lanes_f64 f64_load(const float *p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
static inline lanes_f64 f64_set1(double x) { return _mm256_set1_pd(x); }
static inline lanes_f64 f64_fnmadd(lanes_f64 a, lanes_f64 b, lanes_f64 c) { return _mm256_fnmadd_pd(a, b, c); }
#define F64_LANES_WHERE(a, b, predicate) ((unsigned)_mm256_movemask_pd(_mm256_cmp_pd(a, b, predicate)))
#endif

/* U for the LANES tokens whose SplitMix64 inputs are z (uniform(), lane by lane). */
static inline lanes_f64 uniforms(lanes_u64 z) {
    lanes_u64 h = u64_mul(xor_shifted(z, 30), u64_set1(0xBF58476D1CE4E5B9ULL));
    h = u64_mul(xor_shifted(h, 27), u64_set1(0x94D049BB133111EBULL));
    return grid_midpoint(xor_shifted(h, 31));
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
    const lanes_u64 step = u64_set1(LANES * GOLDEN);
    const lanes_f64 one = f64_set1(1.0), zero = f64_set1(0.0), inf = f64_set1(INFINITY);
    double best = 0.0, scale = INFINITY;  /* no leader yet: every positive token passes */
    int64_t best_at = -1;
    unsigned bad = 0;
    lanes_u64 z = u64_add(u64_set1(key), u64_mul(u64_lanes(), u64_set1(GOLDEN)));
    int64_t v = 0;
    for (; v + LANES <= n; v += LANES, z = u64_add(z, step)) {
        lanes_f64 pd = f64_load(p + v);
        bad |= F64_LANES_WHERE(pd, zero, _CMP_NGE_UQ) | F64_LANES_WHERE(pd, inf, _CMP_EQ_OQ);  /* < 0, NaN, inf */
        lanes_f64 bar = f64_fnmadd(pd, f64_set1(scale), one);  /* 1 - p margin / best */
        unsigned maybe = F64_LANES_WHERE(uniforms(z), bar, _CMP_GE_OQ) & F64_LANES_WHERE(pd, zero, _CMP_GT_OQ);
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

/* Whether this CPU runs this build of the race: the AVX-512 one needs AVX512DQ (the AVX2 one is
 * loaded only on a CPU with AVX2). */
int decodekit_race_runs(void) {
#ifdef __AVX512DQ__
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512dq");
#else
    return 1;
#endif
}
