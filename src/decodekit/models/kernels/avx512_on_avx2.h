/* The AVX-512 intrinsics the float32 kernels use, on AVX2 + FMA + F16C, lane for lane.
 *
 * A CPU without AVX-512 (most laptops and desktops: AMD Zen 2 and 3, Intel's client cores) runs
 * the same kernel sources compiled with this header (build.py picks the level at run time): each
 * 16-lane vector is a pair of 8-lane halves, a 16-bit lane mask an integer as before, and every
 * operation computes in each lane what the AVX-512 instruction computes there (the same IEEE
 * operation, a fused multiply-add where it fuses), so a kernel's results are the same bits on
 * either CPU. The one horizontal sum, _mm512_reduce_add_ps, adds in GCC's pairing (lanes 8 apart,
 * then 4, 2, 1), which the kernels' own sums of 16 lanes already follow (attention.c).
 *
 * Only what the kernels of this folder call is here (the integer kernel gemm_q8.c takes its input
 * quantisation from here and has an AVX2 dot product of its own, as the sampler race.c has its own
 * loop). The names are the AVX-512 ones, defined as macros after
 * <immintrin.h>, so the kernels read the same on both levels.
 */
#ifndef DECODEKIT_AVX512_ON_AVX2_H
#define DECODEKIT_AVX512_ON_AVX2_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define DK_INLINE static inline __attribute__((always_inline))

typedef struct { __m256 lo, hi; } dk_m512;     /* lanes 0-7, 8-15 */
typedef struct { __m256i lo, hi; } dk_m512i;   /* bytes 0-31, 32-63 */
typedef struct { __m256d lo, hi; } dk_m512d;

#define __m512 dk_m512
#define __m512i dk_m512i
#define __m512d dk_m512d

/* An 8-lane mask vector (all ones where bit l of `bits` is set) from 8 bits. */
DK_INLINE __m256i dk_lanes8(unsigned bits) {
    const __m256i each = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), each), each);
}
DK_INLINE __mmask16 dk_bits16(__m256 lo, __m256 hi) {
    return (__mmask16)((unsigned)_mm256_movemask_ps(lo) | (unsigned)_mm256_movemask_ps(hi) << 8);
}

/* loads, stores, constants ------------------------------------------------------------------ */
DK_INLINE dk_m512 dk_loadu_ps(const void *p) { return (dk_m512){_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8)}; }
DK_INLINE dk_m512 dk_load_ps(const void *p) { return (dk_m512){_mm256_load_ps((const float *)p), _mm256_load_ps((const float *)p + 8)}; }
DK_INLINE void dk_storeu_ps(void *p, dk_m512 a) { _mm256_storeu_ps((float *)p, a.lo), _mm256_storeu_ps((float *)p + 8, a.hi); }
DK_INLINE void dk_store_ps(void *p, dk_m512 a) { _mm256_store_ps((float *)p, a.lo), _mm256_store_ps((float *)p + 8, a.hi); }
DK_INLINE dk_m512i dk_loadu_si512(const void *p) { return (dk_m512i){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)}; }
DK_INLINE void dk_storeu_si512(void *p, dk_m512i a) { _mm256_storeu_si256((__m256i *)p, a.lo), _mm256_storeu_si256((__m256i *)p + 1, a.hi); }
DK_INLINE dk_m512 dk_maskz_loadu_ps(__mmask16 k, const void *p) {
    return (dk_m512){_mm256_maskload_ps((const float *)p, dk_lanes8(k & 0xff)), _mm256_maskload_ps((const float *)p + 8, dk_lanes8(k >> 8))};
}
/* Masked stores: a half whose 8 lanes are all stored is one plain store (vmaskmovps stores are
 * slow on some CPUs, AMD's Zen among them, and a full block of keys is the common case). */
DK_INLINE void dk_mask_store8_ps(float *p, unsigned k8, __m256 a) {
    if (k8 == 0xff) _mm256_storeu_ps(p, a);
    else if (k8) _mm256_maskstore_ps(p, dk_lanes8(k8), a);
}
DK_INLINE void dk_mask_storeu_ps(void *p, __mmask16 k, dk_m512 a) {
    dk_mask_store8_ps((float *)p, k & 0xff, a.lo), dk_mask_store8_ps((float *)p + 8, k >> 8, a.hi);
}
DK_INLINE void dk_mask_storeu_epi32(void *p, __mmask16 k, dk_m512i a) {
    dk_mask_store8_ps((float *)p, k & 0xff, _mm256_castsi256_ps(a.lo)), dk_mask_store8_ps((float *)p + 8, k >> 8, _mm256_castsi256_ps(a.hi));
}
DK_INLINE dk_m512 dk_set1_ps(float x) { __m256 v = _mm256_set1_ps(x); return (dk_m512){v, v}; }
DK_INLINE dk_m512 dk_setzero_ps(void) { return (dk_m512){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
DK_INLINE dk_m512i dk_set1_epi32(int x) { __m256i v = _mm256_set1_epi32(x); return (dk_m512i){v, v}; }
DK_INLINE dk_m512i dk_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8, int e9,
                                 int e10, int e11, int e12, int e13, int e14, int e15) {
    return (dk_m512i){_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7), _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15)};
}
DK_INLINE dk_m512i dk_set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8, int e7, int e6,
                                int e5, int e4, int e3, int e2, int e1, int e0) {
    return dk_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15);
}
DK_INLINE dk_m512 dk_broadcastss_ps(__m128 a) { __m256 v = _mm256_broadcastss_ps(a); return (dk_m512){v, v}; }

/* float arithmetic ------------------------------------------------------------------------- */
#define DK_FLOAT2(NAME, OP) \
    DK_INLINE dk_m512 NAME(dk_m512 a, dk_m512 b) { return (dk_m512){OP(a.lo, b.lo), OP(a.hi, b.hi)}; }
DK_FLOAT2(dk_add_ps, _mm256_add_ps)
DK_FLOAT2(dk_sub_ps, _mm256_sub_ps)
DK_FLOAT2(dk_mul_ps, _mm256_mul_ps)
DK_FLOAT2(dk_div_ps, _mm256_div_ps)
DK_FLOAT2(dk_max_ps, _mm256_max_ps)
DK_FLOAT2(dk_min_ps, _mm256_min_ps)
#define DK_FLOAT3(NAME, OP) \
    DK_INLINE dk_m512 NAME(dk_m512 a, dk_m512 b, dk_m512 c) { return (dk_m512){OP(a.lo, b.lo, c.lo), OP(a.hi, b.hi, c.hi)}; }
DK_FLOAT3(dk_fmadd_ps, _mm256_fmadd_ps)
DK_FLOAT3(dk_fnmadd_ps, _mm256_fnmadd_ps)
DK_FLOAT3(dk_fmaddsub_ps, _mm256_fmaddsub_ps)
DK_INLINE dk_m512 dk_abs_ps(dk_m512 a) {
    __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return (dk_m512){_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
/* round to an integer (the kernels ask for nearest, ties to even): the scale bits imm[7:4] must
 * be 0, as they are in every use */
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(a, imm) ((dk_m512){_mm256_round_ps((a).lo, (imm) & 0x0f), _mm256_round_ps((a).hi, (imm) & 0x0f)})
/* a * 2^floor(b): as two exact power-of-two products, so that the result is rounded once, as
 * vscalefps rounds it. Exact for what vexp passes (|floor(b)| <= 252, a finite, b not NaN: each
 * half of b is then a float's exponent); not vscalefps for a NaN or infinite b, nor for a b past
 * +-252 that the instruction would still bring back into range. */
DK_INLINE __m256 dk_pow2(__m256i n) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)); }
DK_INLINE __m256 dk_scalef8(__m256 a, __m256 b) {
    __m256i n = _mm256_cvtps_epi32(_mm256_floor_ps(_mm256_max_ps(_mm256_min_ps(b, _mm256_set1_ps(252.0f)), _mm256_set1_ps(-252.0f))));
    __m256i half = _mm256_srai_epi32(n, 1);
    return _mm256_mul_ps(_mm256_mul_ps(a, dk_pow2(half)), dk_pow2(_mm256_sub_epi32(n, half)));
}
DK_INLINE dk_m512 dk_scalef_ps(dk_m512 a, dk_m512 b) { return (dk_m512){dk_scalef8(a.lo, b.lo), dk_scalef8(a.hi, b.hi)}; }

/* _mm512_reduce_add_ps as GCC computes it: halves added lane by lane, then quarters, then pairs */
DK_INLINE float dk_reduce_add_ps(dk_m512 a) {
    __m256 eight = _mm256_add_ps(a.hi, a.lo);
    __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
    __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
DK_INLINE float dk_reduce_max_ps(dk_m512 a) {
    __m256 eight = _mm256_max_ps(a.hi, a.lo);
    __m128 four = _mm_max_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
    __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}

/* shuffles (within 128-bit lanes, as on AVX-512, except shuffle_f32x4) ------------------------ */
#undef _mm512_shuffle_ps
#define _mm512_shuffle_ps(a, b, imm) ((dk_m512){_mm256_shuffle_ps((a).lo, (b).lo, imm), _mm256_shuffle_ps((a).hi, (b).hi, imm)})
#undef _mm512_permute_ps
#define _mm512_permute_ps(a, imm) ((dk_m512){_mm256_permute_ps((a).lo, imm), _mm256_permute_ps((a).hi, imm)})
/* 128-bit lanes 0, 1 of the result from a's four (picked by imm's bits 0-1, 2-3), 2, 3 from b's */
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, imm)                                                             \
    ((dk_m512){_mm256_permute2f128_ps((a).lo, (a).hi, ((imm) & 3) | (((imm) >> 2) & 3) << 4),       \
               _mm256_permute2f128_ps((b).lo, (b).hi, (((imm) >> 4) & 3) | (((imm) >> 6) & 3) << 4)})
DK_INLINE dk_m512 dk_movehdup_ps(dk_m512 a) { return (dk_m512){_mm256_movehdup_ps(a.lo), _mm256_movehdup_ps(a.hi)}; }
DK_INLINE dk_m512 dk_moveldup_ps(dk_m512 a) { return (dk_m512){_mm256_moveldup_ps(a.lo), _mm256_moveldup_ps(a.hi)}; }
DK_FLOAT2(dk_unpacklo_ps, _mm256_unpacklo_ps)
DK_FLOAT2(dk_unpackhi_ps, _mm256_unpackhi_ps)
DK_INLINE dk_m512d dk_unpacklo_pd(dk_m512d a, dk_m512d b) { return (dk_m512d){_mm256_unpacklo_pd(a.lo, b.lo), _mm256_unpacklo_pd(a.hi, b.hi)}; }
DK_INLINE dk_m512d dk_unpackhi_pd(dk_m512d a, dk_m512d b) { return (dk_m512d){_mm256_unpackhi_pd(a.lo, b.lo), _mm256_unpackhi_pd(a.hi, b.hi)}; }

/* casts ------------------------------------------------------------------------------------ */
DK_INLINE dk_m512d dk_castps_pd(dk_m512 a) { return (dk_m512d){_mm256_castps_pd(a.lo), _mm256_castps_pd(a.hi)}; }
DK_INLINE dk_m512 dk_castpd_ps(dk_m512d a) { return (dk_m512){_mm256_castpd_ps(a.lo), _mm256_castpd_ps(a.hi)}; }
DK_INLINE dk_m512i dk_castps_si512(dk_m512 a) { return (dk_m512i){_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
DK_INLINE dk_m512 dk_castsi512_ps(dk_m512i a) { return (dk_m512){_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }

/* integers --------------------------------------------------------------------------------- */
#define DK_INT2(NAME, OP) \
    DK_INLINE dk_m512i NAME(dk_m512i a, dk_m512i b) { return (dk_m512i){OP(a.lo, b.lo), OP(a.hi, b.hi)}; }
DK_INT2(dk_add_epi32, _mm256_add_epi32)
DK_INT2(dk_sub_epi32, _mm256_sub_epi32)
DK_INT2(dk_and_si512, _mm256_and_si256)
DK_INT2(dk_or_si512, _mm256_or_si256)
DK_INT2(dk_xor_si512, _mm256_xor_si256)
DK_INT2(dk_srlv_epi32, _mm256_srlv_epi32)
DK_INLINE dk_m512i dk_slli_epi32(dk_m512i a, unsigned n) { return (dk_m512i){_mm256_slli_epi32(a.lo, (int)n), _mm256_slli_epi32(a.hi, (int)n)}; }
DK_INLINE dk_m512i dk_srli_epi32(dk_m512i a, unsigned n) { return (dk_m512i){_mm256_srli_epi32(a.lo, (int)n), _mm256_srli_epi32(a.hi, (int)n)}; }

/* conversions ------------------------------------------------------------------------------ */
DK_INLINE dk_m512 dk_cvtepi32_ps(dk_m512i a) { return (dk_m512){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
DK_INLINE dk_m512i dk_cvtps_epi32(dk_m512 a) { return (dk_m512i){_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
DK_INLINE dk_m512i dk_cvtepu8_epi32(__m128i a) { return (dk_m512i){_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))}; }
DK_INLINE dk_m512i dk_cvtepi8_epi32(__m128i a) { return (dk_m512i){_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))}; }
DK_INLINE dk_m512i dk_cvtepu16_epi32(__m256i a) {
    return (dk_m512i){_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
/* 16 int32 -> 16 int16, truncated (each value's low 16 bits) */
DK_INLINE __m256i dk_cvtepi32_epi16(dk_m512i a) {
    const __m256i low = _mm256_set1_epi32(0xffff);  /* then packus, which saturates, keeps them as they are */
    __m256i packed = _mm256_packus_epi32(_mm256_and_si256(a.lo, low), _mm256_and_si256(a.hi, low));
    return _mm256_permute4x64_epi64(packed, 0xd8);
}
/* 16 int32 -> 16 int8, saturated */
DK_INLINE __m128i dk_cvtsepi32_epi8(dk_m512i a) {
    __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xd8);
    return _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}

/* 16 int32 -> 16 int8, truncated (each value's low byte: the low byte of its low 16 bits) */
DK_INLINE __m128i dk_cvtepi32_epi8(dk_m512i a) {
    __m256i bytes = _mm256_and_si256(dk_cvtepi32_epi16(a), _mm256_set1_epi16(0xff));  /* packus keeps them */
    return _mm_packus_epi16(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
}
/* the sum of 16 int32 lanes (wrapping, as the instruction's: any order gives the same) */
DK_INLINE int dk_reduce_add_epi32(dk_m512i a) {
    __m256i s = _mm256_add_epi32(a.lo, a.hi);
    __m128i q = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xb1)));
}

/* lane masks ------------------------------------------------------------------------------- */
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask(a, b, imm) dk_bits16(_mm256_cmp_ps((a).lo, (b).lo, imm), _mm256_cmp_ps((a).hi, (b).hi, imm))
#undef _mm512_mask_cmp_ps_mask
#define _mm512_mask_cmp_ps_mask(k, a, b, imm) ((__mmask16)((k) & _mm512_cmp_ps_mask(a, b, imm)))
DK_INLINE dk_m512 dk_mask_mov_ps(dk_m512 src, __mmask16 k, dk_m512 a) {
    return (dk_m512){_mm256_blendv_ps(src.lo, a.lo, _mm256_castsi256_ps(dk_lanes8(k & 0xff))),
                     _mm256_blendv_ps(src.hi, a.hi, _mm256_castsi256_ps(dk_lanes8(k >> 8)))};
}
DK_INLINE dk_m512 dk_mask_blend_ps(__mmask16 k, dk_m512 a, dk_m512 b) { return dk_mask_mov_ps(a, k, b); }
DK_INLINE dk_m512 dk_maskz_mov_ps(__mmask16 k, dk_m512 a) { return dk_mask_mov_ps(dk_setzero_ps(), k, a); }
DK_INLINE dk_m512i dk_mask_mov_epi32(dk_m512i src, __mmask16 k, dk_m512i a) {
    return (dk_m512i){_mm256_blendv_epi8(src.lo, a.lo, dk_lanes8(k & 0xff)), _mm256_blendv_epi8(src.hi, a.hi, dk_lanes8(k >> 8))};
}
/* the lanes of k, packed to the front in order, zeros after (floats moved as their bits) */
DK_INLINE dk_m512i dk_maskz_compress_epi32(__mmask16 k, dk_m512i a) {
    int32_t in[16], out[16] = {0};
    dk_storeu_si512(in, a);
    for (int l = 0, n = 0; l < 16; l++)
        if (k >> l & 1) out[n++] = in[l];
    return dk_loadu_si512(out);
}
DK_INLINE dk_m512 dk_maskz_compress_ps(__mmask16 k, dk_m512 a) { return dk_castsi512_ps(dk_maskz_compress_epi32(k, dk_castps_si512(a))); }
/* a set bit for each nonzero byte */
DK_INLINE uint64_t dk_test_epi8_mask(dk_m512i a, dk_m512i b) {
    const __m256i zero = _mm256_setzero_si256();
    uint32_t lo = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(a.lo, b.lo), zero));
    uint32_t hi = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(a.hi, b.hi), zero));
    return ~((uint64_t)hi << 32 | lo);
}
DK_INLINE __mmask16 dk_mm_test_epi8_mask(__m128i a, __m128i b) {
    return (__mmask16)~_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(a, b), _mm_setzero_si128()));
}
/* 16 bytes, those outside k read as zero (and never touched: they may lie past the data) */
DK_INLINE __m128i dk_mm_maskz_loadu_epi8(__mmask16 k, const void *p) {
    uint8_t bytes[16] = {0};
    if (k == 0xffff) return _mm_loadu_si128((const __m128i *)p);
    for (int l = 0; l < 16; l++)
        if (k >> l & 1) bytes[l] = ((const uint8_t *)p)[l];
    return _mm_loadu_si128((const __m128i *)bytes);
}

/* the names the kernels use (some are macros in GCC's own header, the shifts at -O0) */
#undef _mm512_setr_epi32
#undef _mm512_slli_epi32
#undef _mm512_srli_epi32
#define _mm512_loadu_ps dk_loadu_ps
#define _mm512_load_ps dk_load_ps
#define _mm512_storeu_ps dk_storeu_ps
#define _mm512_store_ps dk_store_ps
#define _mm512_loadu_si512 dk_loadu_si512
#define _mm512_storeu_si512 dk_storeu_si512
#define _mm512_maskz_loadu_ps dk_maskz_loadu_ps
#define _mm512_mask_storeu_ps dk_mask_storeu_ps
#define _mm512_mask_storeu_epi32 dk_mask_storeu_epi32
#define _mm512_set1_ps dk_set1_ps
#define _mm512_setzero_ps dk_setzero_ps
#define _mm512_set1_epi32 dk_set1_epi32
#define _mm512_setr_epi32 dk_setr_epi32
#define _mm512_set_epi32 dk_set_epi32
#define _mm512_broadcastss_ps dk_broadcastss_ps
#define _mm512_add_ps dk_add_ps
#define _mm512_sub_ps dk_sub_ps
#define _mm512_mul_ps dk_mul_ps
#define _mm512_div_ps dk_div_ps
#define _mm512_max_ps dk_max_ps
#define _mm512_min_ps dk_min_ps
#define _mm512_fmadd_ps dk_fmadd_ps
#define _mm512_fnmadd_ps dk_fnmadd_ps
#define _mm512_fmaddsub_ps dk_fmaddsub_ps
#define _mm512_abs_ps dk_abs_ps
#define _mm512_scalef_ps dk_scalef_ps
#define _mm512_reduce_add_ps dk_reduce_add_ps
#define _mm512_reduce_max_ps dk_reduce_max_ps
#define _mm512_movehdup_ps dk_movehdup_ps
#define _mm512_moveldup_ps dk_moveldup_ps
#define _mm512_unpacklo_ps dk_unpacklo_ps
#define _mm512_unpackhi_ps dk_unpackhi_ps
#define _mm512_unpacklo_pd dk_unpacklo_pd
#define _mm512_unpackhi_pd dk_unpackhi_pd
#define _mm512_castps_pd dk_castps_pd
#define _mm512_castpd_ps dk_castpd_ps
#define _mm512_castps_si512 dk_castps_si512
#define _mm512_castsi512_ps dk_castsi512_ps
#define _mm512_add_epi32 dk_add_epi32
#define _mm512_sub_epi32 dk_sub_epi32
#define _mm512_and_si512 dk_and_si512
#define _mm512_or_si512 dk_or_si512
#define _mm512_xor_si512 dk_xor_si512
#define _mm512_srlv_epi32 dk_srlv_epi32
#define _mm512_slli_epi32 dk_slli_epi32
#define _mm512_srli_epi32 dk_srli_epi32
#define _mm512_cvtepi32_ps dk_cvtepi32_ps
#define _mm512_cvtps_epi32 dk_cvtps_epi32
#define _mm512_cvtepu8_epi32 dk_cvtepu8_epi32
#define _mm512_cvtepi8_epi32 dk_cvtepi8_epi32
#define _mm512_cvtepu16_epi32 dk_cvtepu16_epi32
#define _mm512_cvtepi32_epi16 dk_cvtepi32_epi16
#define _mm512_cvtsepi32_epi8 dk_cvtsepi32_epi8
#define _mm512_cvtepi32_epi8 dk_cvtepi32_epi8
#define _mm512_reduce_add_epi32 dk_reduce_add_epi32
#define _mm512_mask_mov_ps dk_mask_mov_ps
#define _mm512_mask_blend_ps dk_mask_blend_ps
#define _mm512_maskz_mov_ps dk_maskz_mov_ps
#define _mm512_mask_mov_epi32 dk_mask_mov_epi32
#define _mm512_maskz_compress_ps dk_maskz_compress_ps
#define _mm512_maskz_compress_epi32 dk_maskz_compress_epi32
#define _mm512_test_epi8_mask dk_test_epi8_mask
#define _mm_test_epi8_mask dk_mm_test_epi8_mask
#define _mm_maskz_loadu_epi8 dk_mm_maskz_loadu_epi8

#endif
