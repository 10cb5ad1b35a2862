/* The `fast` numerics: GGUF weight blocks (Q4_1, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K) times inputs quantised to
 * 8 bits, with integer dot products (AVX512-VNNI's vpdpbusd: 64 products of an unsigned and a
 * signed byte, summed four by four into 16 int32 lanes, per instruction; on a CPU without VNNI,
 * AVX2's vpmaddubsw and vpmaddwd give the same sums, 8 rows a vector: see the AVX2 section).
 *
 * Inputs. Each input row is quantised per block of 32 values as llama.cpp's Q8_1 does:
 * dx = max|x| / 127, qx = nearest integer to x * (1 / dx), sx = the block's sum of qx.
 *
 * Weights are repacked once (decodekit_q8_pack) in groups of 16 output rows: for each sub-block of
 * 32 inputs, the 16 rows' 4-byte slices k = 4g..4g+3 side by side in one 64-byte vector, so one
 * vpdpbusd multiplies 16 rows by 4 inputs of one input row (broadcast) with no horizontal sums.
 * Every weight is s * (u - z) + n with an unsigned integer u (the vpdpbusd operand as it is): a
 * Q8_0 weight d * q is stored as q + 128 and its sum corrected by -128 * sx, exactly, and Q5_0's
 * q - 16 by -16 * sx; a Q6_K
 * weight's q - 32 likewise, by -32 times each half's sum (it has a scale per 16 weights).
 *
 * Arithmetic, for output row r and input row m (the scalar reference below spells it out, and a
 * test compares the vector kernel with it bit for bit):
 *     acc = 0;  for each sub-block b:  acc = fma((float) isum_b, s_b * dx_b, acc)
 *                                       acc = fma(n_b, dx_b * (float) sx_b, acc)   (Q4_1, Q4_K, Q5_K)
 *     y = acc
 * where isum_b = sum_k (u_k - z) qx_k is exact in int32 (Q6_K: two sums and two scales, in order).
 * Every (r, m) pair is computed alone, in that order, whatever else is in the pass, so a token's
 * logits are the same in a plain step, in a verification tree, in a batch, and in prefill. Groups
 * of rows are split between threads, and so are the input's blocks to quantise in a pass of several
 * rows (each block is quantised on its own).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decodekit.h"
#include "gguf.h"
#include "simd.h"

#define QK 32
#define GROUP DECODEKIT_Q8_GROUP
#define TILE 8     /* input rows a group's unpacked weights are used for before they are rebuilt (VNNI) */
#define SHARED_QUANTISATION 128 /* input blocks from which the threads quantise them together */
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 8 /* how far ahead a pass of several rows asks for its weights */
#endif

/* Kinds of weights (the `kind` argument): GGUF blocks as the file has them, and their packed form
 * per group of 16 rows and sub-block of 32 weights (unsigned weights u, 64 bytes per 4 inputs):
 *   0 Q4_1 {fp16 d, fp16 m, 16 bytes of nibbles: weight j low, j + 16 high} (20 bytes a block of 32)
 *       -> w = d u + m;                 packed {4 x 64 bytes of nibble pairs, 16 fp16 d, 16 fp16 m}
 *   1 Q8_0 {fp16 d, int8 q[32]} (34)    -> w = d (u - 128), u = q + 128;  {8 x 64 bytes, 16 fp16 d}
 *   2 Q4_K, 4 Q5_K (144, 176 bytes a block of 256; see gemm.c) -> w = s u + n, with the sub-block's
 *       s = d * scale and n = -(dmin * min) in float32;  {4 x 64 nibble pairs (Q4_K) or 8 x 64
 *       bytes (Q5_K), 16 float s, 16 float n}
 *   3 Q6_K (210 bytes a block of 256) -> w = s_h (u - 32), one s_h = d * scale per 16 weights;
 *       {8 x 64 bytes, 16 float s_0 (weights 0-15), 16 float s_1 (16-31)}
 *   5 Q5_0 {fp16 d, 32 fifth bits, 16 bytes of nibbles as Q4_1's} (22) -> w = d (u - 16);
 *       {4 x 64 nibble pairs, 8 x 8 bytes of fifth bits (one 64-bit mask per 64-byte vector of
 *       weights, bit i for byte i), 16 fp16 d}: as many bytes as the file's
 * The K-quants' sub-block scales are products of a float16 and a small integer: exact in float32. */
#define Q4_1_PACKED (4 * 64 + 2 * GROUP * 2)
#define Q8_0_PACKED (8 * 64 + GROUP * 2)
#define Q4_K_PACKED (4 * 64 + 2 * GROUP * 4)
#define WIDE_PACKED (8 * 64 + 2 * GROUP * 4) /* Q5_K, Q6_K */
#define Q5_0_PACKED (4 * 64 + 64 + GROUP * 2)
static const int FILE_BYTES[KINDS] = {Q4_1_BYTES, Q8_0_BYTES, Q4_K_BYTES, Q6_K_BYTES, Q5_K_BYTES, Q5_0_BYTES};
static const int FILE_WEIGHTS[KINDS] = {SMALL_BLOCK_WEIGHTS, SMALL_BLOCK_WEIGHTS, K_BLOCK_WEIGHTS, K_BLOCK_WEIGHTS,
                                        K_BLOCK_WEIGHTS, SMALL_BLOCK_WEIGHTS};
static const int PACKED_BYTES[KINDS] = {Q4_1_PACKED, Q8_0_PACKED, Q4_K_PACKED, WIDE_PACKED, WIDE_PACKED, Q5_0_PACKED};
static const int SCALES_AT[KINDS] = {256, 512, 256, 512, 512, 320};    /* where a packed block's scales start */
static inline int nibble_kind(int kind) { return kind == KIND_Q4_1 || kind == KIND_Q4_K || kind == KIND_Q5_0; }
static inline int half_scales(int kind) { return kind == KIND_Q4_1 || kind == KIND_Q8_0 || kind == KIND_Q5_0; }

/* Bytes of the packed form of a [n_out, n_in] matrix (what Python allocates). */
int64_t decodekit_q8_packed_bytes(int kind, int n_out, int n_in) {
    return (int64_t)(n_out / GROUP) * (n_in / QK) * PACKED_BYTES[kind];
}

/* Sub-block b (weights 32 b .. 32 b + 31) of a row of file blocks, decoded: u[32], and the scales
 * and offset of its kind (see above; for Q4_1 / Q8_0 the float16 values, widened). */
typedef struct {
    uint8_t u[QK];
    float s[2], n;
} SubBlock;

static void decode_sub_block(int kind, const uint8_t *row, int b, SubBlock *out) {
    const uint8_t *block = row + (size_t)(b * QK / FILE_WEIGHTS[kind]) * FILE_BYTES[kind];
    int j = b % (FILE_WEIGHTS[kind] / QK);  /* sub-block within a K-quant block */
    out->n = 0.0f;
    if (kind == KIND_Q4_1) {
        for (int k = 0; k < QK; k++) out->u[k] = k < 16 ? block[4 + k] & 0x0f : block[4 + k - 16] >> 4;
        out->s[0] = out->s[1] = half_to_float(block), out->n = half_to_float(block + 2);
    } else if (kind == KIND_Q8_0) {
        for (int k = 0; k < QK; k++) out->u[k] = (uint8_t)((int8_t)block[2 + k] + 128);
        out->s[0] = out->s[1] = half_to_float(block);
    } else if (kind == KIND_Q5_0) {
        uint32_t fifth;
        memcpy(&fifth, block + 2, 4);
        for (int k = 0; k < QK; k++)
            out->u[k] = (uint8_t)((k < 16 ? block[6 + k] & 0x0f : block[6 + k - 16] >> 4) | (((fifth >> k) & 1) << 4));
        out->s[0] = out->s[1] = half_to_float(block);
    } else if (kind == KIND_Q4_K || kind == KIND_Q5_K) {
        int scale, min, q5 = kind == KIND_Q5_K;
        const uint8_t *qs = block + (q5 ? 48 : 16) + 32 * (j / 2);
        for (int k = 0; k < QK; k++) {
            int v = (j & 1) ? qs[k] >> 4 : qs[k] & 0x0f;
            out->u[k] = (uint8_t)(q5 ? v | (((block[16 + k] >> j) & 1) << 4) : v);
        }
        k_scale_min(block + 4, j, &scale, &min);
        out->s[0] = out->s[1] = half_to_float(block) * (float)scale;
        out->n = -(half_to_float(block + 2) * (float)min);
    } else { /* Q6_K: sub-block j is half h = j / 4, quarter j % 4 of it */
        int h = j / 4, quarter = j % 4;
        const uint8_t *ql = block + 64 * h + 32 * (quarter & 1), *qh = block + 128 + 32 * h;
        for (int k = 0; k < QK; k++)
            out->u[k] = (uint8_t)((quarter >= 2 ? ql[k] >> 4 : ql[k] & 0x0f) | (((qh[k] >> (2 * quarter)) & 3) << 4));
        const int8_t *scales = (const int8_t *)(block + 192) + 2 * j;
        float d = half_to_float(block + 208);
        out->s[0] = d * (float)scales[0], out->s[1] = d * (float)scales[1];
    }
}

/* Inputs quantised: q [M][n_in] int8; per row and block, dx (scale), ex = dx * sx (the offset's
 * factor), cx = -128 * sx (the Q8_0 correction), and -32 times the sums of the block's halves
 * (c0, c1: Q6_K's corrections, one per scale). */
typedef struct {
    int8_t *q;
    float *dx, *ex;
    int32_t *cx, *c0, *c1;
} Quantised;

static int quantised_alloc(Quantised *in, int M, int n_in) {
    size_t blocks = (size_t)M * (n_in / QK);
    in->q = aligned_alloc(64, ((size_t)M * n_in + 63) / 64 * 64);
    in->dx = malloc(blocks * sizeof(float));
    in->ex = malloc(blocks * sizeof(float));
    in->cx = malloc(blocks * sizeof(int32_t));
    in->c0 = malloc(blocks * sizeof(int32_t));
    in->c1 = malloc(blocks * sizeof(int32_t));
    return in->q && in->dx && in->ex && in->cx && in->c0 && in->c1;
}

static void quantised_free(Quantised *in) {
    free(in->q), free(in->dx), free(in->ex), free(in->cx), free(in->c0), free(in->c1);
}

/* One block's scale, or NaN when a value is not finite (its quantised values are then 0: the
 * results come out NaN, never silently finite); s0, s1: the sums of its two halves. */
static void finish_block(Quantised *in, size_t at, float dx, int32_t s0, int32_t s1) {
    in->dx[at] = dx;
    in->ex[at] = dx * (float)(s0 + s1);
    in->cx[at] = -128 * (s0 + s1);
    in->c0[at] = -32 * s0;
    in->c1[at] = -32 * s1;
}

/* 1 / dx, or 0 where dx is 0 or so small (a block of values below ~3.7e-37) that its inverse is
 * infinite: such a block is quantised to zeros (0 * inf would be NaN, converted differently by the
 * scalar and the vector code). */
static inline float inverse_scale(float dx) {
    float inv = dx > 0.0f ? 1.0f / dx : 0.0f;
    return isinf(inv) ? 0.0f : inv;
}

/* Scalar quantisation (the reference's). */
static void quantize_scalar(const float *x, int M, int n_in, Quantised *in) {
    int nb = n_in / QK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)m * n_in + (size_t)b * QK;
            int8_t *qb = in->q + (size_t)m * n_in + (size_t)b * QK;
            float amax = 0.0f;
            int finite = 1;
            for (int j = 0; j < QK; j++) {
                amax = fmaxf(amax, fabsf(xb[j]));
                finite &= isfinite(xb[j]) != 0;
            }
            float dx = amax / 127.0f, inv = inverse_scale(dx);
            int32_t sx[2] = {0, 0};
            for (int j = 0; j < QK; j++) {
                /* clamped: x * inv can round past 127 by an ulp, and must never be converted out of range */
                int v = finite ? (int)nearbyintf(fminf(127.0f, fmaxf(-127.0f, xb[j] * inv))) : 0;
                qb[j] = (int8_t)v;
                sx[j / 16] += v;
            }
            finish_block(in, (size_t)m * nb + b, finite ? dx : NAN, sx[0], sx[1]);
        }
}

/* The same, 16 values a vector (the conversion rounds to nearest even, as nearbyintf does), for
 * blocks `first .. last - 1` of the M x (n_in / QK) input blocks, row after row: each block on its
 * own, so threads may share the rows' blocks between them. */
static void quantize_vector(const float *x, size_t first, size_t last, Quantised *in) {
    const __m512 limit = _mm512_set1_ps(127.0f), below = _mm512_set1_ps(-127.0f), infinity = _mm512_set1_ps(INFINITY);
    for (size_t at = first; at < last; at++) {
        const float *xb = x + at * QK; /* (rows are n_in = nb * QK values: block `at` starts at at * QK) */
        int8_t *qb = in->q + at * QK;
        __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
        /* not less than infinity, or unordered: infinite or NaN */
        int finite = !(_mm512_cmp_ps_mask(a0, infinity, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(a1, infinity, _CMP_NLT_UQ));
        if (!finite) {
            memset(qb, 0, QK);
            finish_block(in, at, NAN, 0, 0);
            continue;
        }
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        float dx = amax / 127.0f, inv = inverse_scale(dx);
        __m512 scale = _mm512_set1_ps(inv);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(limit, _mm512_max_ps(below, _mm512_mul_ps(x0, scale))));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(limit, _mm512_max_ps(below, _mm512_mul_ps(x1, scale))));
        _mm_storeu_si128((__m128i *)qb, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtepi32_epi8(q1));
        finish_block(in, at, dx, _mm512_reduce_add_epi32(q0), _mm512_reduce_add_epi32(q1));
    }
}

/* Repack GGUF blocks (rows of n_in weights; n_out a multiple of 16) into the kernel's layout. */
void decodekit_q8_pack(int kind, const uint8_t *w, uint8_t *packed, int n_out, int n_in) {
    int nb = n_in / QK, size = PACKED_BYTES[kind], weights = SCALES_AT[kind];
    size_t row_bytes = (size_t)(n_in / FILE_WEIGHTS[kind]) * FILE_BYTES[kind];
    for (int g = 0; g < n_out / GROUP; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *out = packed + ((size_t)g * nb + b) * size;
            memset(out, 0, weights);
            for (int r = 0; r < GROUP; r++) {
                const uint8_t *row = w + (size_t)(g * GROUP + r) * row_bytes;
                SubBlock sub;
                decode_sub_block(kind, row, b, &sub);
                for (int k = 0; k < QK; k++) {
                    int chunk = k / 4, slot = r * 4 + k % 4;
                    if (nibble_kind(kind)) /* k < 16: the low nibble of chunk k / 4; else the high one of chunk k / 4 - 4 */
                        out[(chunk % 4) * 64 + slot] |= (uint8_t)((sub.u[k] & 0x0f) << (chunk < 4 ? 0 : 4));
                    else
                        out[chunk * 64 + slot] = sub.u[k];
                    if (kind == KIND_Q5_0) /* the fifth bit: bit `slot` of chunk's 64-bit mask */
                        out[256 + chunk * 8 + slot / 8] |= (uint8_t)((sub.u[k] >> 4) << (slot % 8));
                }
                if (half_scales(kind)) { /* the file's float16 d (and m), as they are */
                    const uint8_t *block = row + (size_t)b * FILE_BYTES[kind];
                    memcpy(out + weights + 2 * r, block, 2);
                    if (kind == KIND_Q4_1) memcpy(out + weights + 2 * GROUP + 2 * r, block + 2, 2);
                } else {
                    float second = kind == KIND_Q6_K ? sub.s[1] : sub.n;
                    memcpy(out + weights + 4 * r, &sub.s[0], 4);
                    memcpy(out + weights + 4 * GROUP + 4 * r, &second, 4);
                }
            }
        }
}

#ifdef __AVX512VNNI__ /* 16 rows a vector, vpdpbusd */
#define PAIR_GROUPS 1

/* A packed block's 32 x 16 unsigned weights as 8 vectors: vector j holds inputs 4j .. 4j + 3 of the
 * 16 rows (the packed layout, nibbles split apart and Q5_0's fifth bits put back). */
static inline __attribute__((always_inline)) void unpack_weights(int kind, const uint8_t *block, __m512i w[8]) {
    if (nibble_kind(kind)) {
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (int j = 0; j < 4; j++) {
            __m512i packed = _mm512_loadu_si512((const void *)(block + 64 * j));
            w[j] = _mm512_and_si512(packed, low);
            w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
        if (kind == KIND_Q5_0) { /* the fifth bits: 16 where a chunk's mask has its bit */
            const __m512i sixteen = _mm512_set1_epi8(16);
            for (int j = 0; j < 8; j++) {
                __mmask64 fifth;
                memcpy(&fifth, block + 256 + 8 * j, 8);
                w[j] = _mm512_or_si512(w[j], _mm512_maskz_mov_epi8(fifth, sixteen));
            }
        }
    } else {
        for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(block + 64 * j));
    }
}

/* A packed block's 16 rows' first scale (s0) and their offset or second scale (s1), in float32. */
static inline __attribute__((always_inline)) void load_scales(int kind, const uint8_t *block, __m512 *s0, __m512 *s1) {
    const uint8_t *scales = block + SCALES_AT[kind];
    if (half_scales(kind)) {
        *s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
        *s1 = kind == KIND_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 2 * GROUP)))
                                : _mm512_setzero_ps();
    } else {
        *s0 = _mm512_loadu_ps(scales);
        *s1 = _mm512_loadu_ps(scales + 4 * GROUP);
    }
}

/* The corrections of offset weights that start an input block's integer sums: -128 sx (Q8_0),
 * -16 sx (Q5_0), -32 per half (Q6_K: `first` for weights 0-15, `second` for 16-31), else none. */
static inline __attribute__((always_inline)) void corrections(int kind, const Quantised *in, size_t at, __m512i *first,
                                                              __m512i *second) {
    int32_t correction = kind == KIND_Q8_0 ? in->cx[at] : kind == KIND_Q5_0 ? in->cx[at] / 8 : 0;
    *first = _mm512_set1_epi32(kind == KIND_Q6_K ? in->c0[at] : correction);
    *second = _mm512_set1_epi32(in->c1[at]);
}

/* acc plus one block's share for input block `at`, from its integer sums (corrections included):
 * the arithmetic of the header comment, for 16 output rows at once. */
static inline __attribute__((always_inline)) __m512 add_block(int kind, __m512 acc, __m512i isum0, __m512i isum1,
                                                              __m512 s0, __m512 s1, const Quantised *in, size_t at) {
    __m512 dx = _mm512_set1_ps(in->dx[at]);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum0), _mm512_mul_ps(s0, dx), acc);
    if (kind == KIND_Q6_K)
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum1), _mm512_mul_ps(s1, dx), acc);
    else if (kind != KIND_Q8_0 && kind != KIND_Q5_0)
        acc = _mm512_fmadd_ps(s1, _mm512_set1_ps(in->ex[at]), acc);
    return acc;
}

/* acc + w . (4 signed bytes at x, broadcast), as _mm512_dpbusd_epi32 with _mm512_set1_epi32, but
 * with the broadcast folded into the instruction's memory operand ({1to16}), which GCC does not do
 * by itself: a separate vpbroadcastd per product takes a vector pipe's slot. */
static inline __attribute__((always_inline)) __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}

/* G groups of 16 output rows (G = 1 or 2; the second group `stride` bytes after the first)
 * against input rows m0 .. m0 + T - 1. Two groups share each broadcast input and each input's
 * scales: more multiply-adds per instruction for passes of several rows. `kind` is a constant
 * once inlined, so each kind compiles to a loop of its own. */
static inline __attribute__((always_inline)) void group_tile(int kind, const uint8_t *group, size_t stride,
                                                              const Quantised *in, float *y, int n_out, int n_in,
                                                              int m0, const int T, const int G) {
    int nb = n_in / QK, size = PACKED_BYTES[kind];
    __m512 acc[2][TILE];
    for (int g = 0; g < G; g++)
        for (int t = 0; t < T; t++) acc[g][t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i w[2][8];
        __m512 s0[2], s1[2];
        for (int g = 0; g < G; g++) {
            const uint8_t *block = group + g * stride + (size_t)b * size;
            /* ask for the weights a few blocks ahead: their multiply-adds then hide the wait (in a
             * one-row pass too: on an Intel Xeon the prefetchers alone left it waiting on memory) */
            ask_for(block + PREFETCH_BLOCKS * size, (size_t)size);
            unpack_weights(kind, block, w[g]);
            load_scales(kind, block, &s0[g], &s1[g]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            size_t at = (size_t)(m0 + t) * nb + b;
            const int8_t *xq = in->q + (size_t)(m0 + t) * n_in + (size_t)b * QK;
            int halves = kind == KIND_Q6_K;
            __m512i first, second;
            corrections(kind, in, at, &first, &second);
            /* two chains of four products, one per half of the block: Q6_K keeps them apart (a
             * scale each); the others add them up (integer sums are exact in any order, and a
             * single chain of eight would wait on the instruction's latency) */
            __m512i isum[2][2];
            for (int g = 0; g < G; g++) isum[g][0] = first, isum[g][1] = halves ? second : _mm512_setzero_si512();
            for (int j = 0; j < 8; j++)
                for (int g = 0; g < G; g++) isum[g][j / 4] = dpbusd_broadcast(isum[g][j / 4], w[g][j], xq + 4 * j);
            if (!halves)
                for (int g = 0; g < G; g++) isum[g][0] = _mm512_add_epi32(isum[g][0], isum[g][1]);
            for (int g = 0; g < G; g++) acc[g][t] = add_block(kind, acc[g][t], isum[g][0], isum[g][1], s0[g], s1[g], in, at);
        }
    }
    for (int g = 0; g < G; g++)
        for (int t = 0; t < T; t++) _mm512_storeu_ps(y + (size_t)(m0 + t) * n_out + g * GROUP, acc[g][t]);
}

/* Tiles of TILE input rows for one group, TILE / 2 for a pair of groups (registers: a pair's
 * unpacked weights take 16 of the 32 vector registers). */
#define TILE_CASE(T, G) case T: group_tile(kind, group, stride, in, y, n_out, n_in, m0, T, G); break;
#define DEFINE_GROUP(NAME, KIND)                                                                     \
    static void NAME(const uint8_t *group, size_t stride, int pair, const Quantised *in, float *y,  \
                     int M, int n_out, int n_in) {                                                   \
        const int kind = KIND;                                                                       \
        if (pair)                                                                                    \
            for (int m0 = 0; m0 < M; m0 += TILE / 2)                                                 \
                switch (M - m0 < TILE / 2 ? M - m0 : TILE / 2) {                                     \
                    TILE_CASE(1, 2) TILE_CASE(2, 2) TILE_CASE(3, 2) TILE_CASE(4, 2)                  \
                }                                                                                    \
        else                                                                                         \
            for (int m0 = 0; m0 < M; m0 += TILE)                                                     \
                switch (M - m0 < TILE ? M - m0 : TILE) {                                             \
                    TILE_CASE(1, 1) TILE_CASE(2, 1) TILE_CASE(3, 1) TILE_CASE(4, 1)                  \
                    TILE_CASE(5, 1) TILE_CASE(6, 1) TILE_CASE(7, 1) TILE_CASE(8, 1)                  \
                }                                                                                    \
    }

#else /* AVX2 + FMA + F16C, without VNNI: the same integer sums from vpmaddubsw, half a group a vector */

/* vpmaddubsw multiplies 32 unsigned bytes by 32 signed ones and adds neighbours into 16 int16
 * lanes, saturating; vpmaddwd then adds neighbouring int16 lanes into int32 lanes of four products,
 * what a vpdpbusd lane holds. That is exact while no int16 sum passes 32767: inputs lie within
 * +-127, so a pair of products of 4-bit weights (u <= 15) is at most 3810 and eight of them add up
 * in int16 (30480) before vpmaddwd; 5-bit weights four, 6-bit two (steps_in_int16). Q8_0's u = q +
 * 128 would overflow a pair, so its weights are used signed (q = u - 128, the sign trick:
 * |q| times x with q's sign, at most 32512 a pair) and its sums start at 0 instead of -128 sx: the
 * same integer. Every integer sum is therefore the VNNI kernel's, and the float arithmetic on it is
 * the same operations in the same order, so the results are the same bits at either level. */
#define PAIR_GROUPS 0
#define HALF 8      /* output rows a vector holds: half a group */
#define HALF_TILE 8 /* input rows a half's unpacked weights serve at once (of 3, 4, 6 and 8, the fastest) */
static inline int steps_in_int16(int kind) {
    return kind == KIND_Q8_0 ? 1 : kind == KIND_Q6_K ? 2 : kind == KIND_Q5_0 || kind == KIND_Q5_K ? 4 : 8;
}

/* Bit i of `bits` as byte i: 0xff where set (Q5_0's fifth bits of 32 weights of a half). */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i byte_of_bit = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)bits), byte_of_bit);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

/* Half h (rows 8h .. 8h + 7) of a packed block's weights as 8 vectors: vector j holds inputs 4j ..
 * 4j + 3 of the 8 rows (the low or high 32 bytes of each 64-byte vector of the packed layout);
 * Q8_0's signed. */
static inline __attribute__((always_inline)) void unpack_half(int kind, const uint8_t *block, int h, __m256i w[8]) {
    if (nibble_kind(kind)) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        for (int j = 0; j < 4; j++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(block + 64 * j + 32 * h));
            w[j] = _mm256_and_si256(packed, low);
            w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        }
        if (kind == KIND_Q5_0) {
            const __m256i sixteen = _mm256_set1_epi8(16);
            for (int j = 0; j < 8; j++) {
                uint32_t fifth;
                memcpy(&fifth, block + 256 + 8 * j + 4 * h, 4);
                w[j] = _mm256_or_si256(w[j], _mm256_and_si256(bits_to_bytes(fifth), sixteen));
            }
        }
    } else {
        const __m256i flip = _mm256_set1_epi8((char)0x80); /* u - 128 = u ^ 0x80 as a signed byte */
        for (int j = 0; j < 8; j++) {
            w[j] = _mm256_loadu_si256((const __m256i *)(block + 64 * j + 32 * h));
            if (kind == KIND_Q8_0) w[j] = _mm256_xor_si256(w[j], flip);
        }
    }
}

/* Half h's 8 rows' first scale (s0) and their offset or second scale (s1), in float32. */
static inline __attribute__((always_inline)) void load_half_scales(int kind, const uint8_t *block, int h, __m256 *s0,
                                                                   __m256 *s1) {
    const uint8_t *scales = block + SCALES_AT[kind];
    if (half_scales(kind)) {
        *s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * HALF * h)));
        *s1 = kind == KIND_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * GROUP + 2 * HALF * h)))
                                : _mm256_setzero_ps();
    } else {
        *s0 = _mm256_loadu_ps((const float *)(scales + 4 * HALF * h));
        *s1 = _mm256_loadu_ps((const float *)(scales + 4 * GROUP + 4 * HALF * h));
    }
}

/* Halves h0 .. h0 + H - 1 (H: 1 or 2) of one group against input rows m0 .. m0 + T - 1: the
 * arithmetic of the header comment for 8 output rows at once. Each block's integer sums are made
 * for every input row first, while its weights take 8 of the 16 vector registers, and turned into
 * floats after: the floats' scales and sums then need no registers during the integer work (fewer
 * spills, measured faster). With both halves in one walk over the blocks, each block's bytes are
 * used together as they arrive from memory: faster for one or two rows (a decode step), whose
 * work per byte is small, and slower for more, whose sums then take twice the registers (measured
 * with Q4_1 layers and a Q8_0 head; the K-quants and Q5_0 take the same walk untimed). Each
 * output row's sum runs over the blocks in the same order either way: the same bits. */
static inline __attribute__((always_inline)) void half_tile(int kind, const uint8_t *group, int h0, const int H,
                                                             const Quantised *in, float *y, int n_out, int n_in,
                                                             int m0, const int T) {
    int nb = n_in / QK, size = PACKED_BYTES[kind], steps = steps_in_int16(kind), halves = kind == KIND_Q6_K;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][HALF_TILE];
    for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++) acc[h][t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *block = group + (size_t)b * size;
        if (h0 == 0) ask_for(block + PREFETCH_BLOCKS * size, (size_t)size);
        for (int h = 0; h < H; h++) {
            __m256i w[8], isum[HALF_TILE][2];
            unpack_half(kind, block, h0 + h, w);
            for (int t = 0; t < T; t++) {
                size_t at = (size_t)(m0 + t) * nb + b;
                const int8_t *xq = in->q + (size_t)(m0 + t) * n_in + (size_t)b * QK;
                int32_t correction = kind == KIND_Q5_0 ? in->cx[at] / 8 : 0; /* Q8_0's: none, its weights are signed */
                isum[t][0] = _mm256_set1_epi32(kind == KIND_Q6_K ? in->c0[at] : correction);
                isum[t][1] = _mm256_set1_epi32(in->c1[at]);
                __m256i part = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {
                    int32_t four;
                    memcpy(&four, xq + 4 * j, 4);
                    __m256i x = _mm256_set1_epi32(four), product;
                    if (kind == KIND_Q8_0)
                        product = _mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(x, w[j]));
                    else
                        product = _mm256_maddubs_epi16(w[j], x);
                    part = j % steps == 0 ? product : _mm256_add_epi16(part, product);
                    if (j % steps == steps - 1) {
                        int half = halves && j >= 4;
                        isum[t][half] = _mm256_add_epi32(isum[t][half], _mm256_madd_epi16(part, ones));
                    }
                }
            }
            __m256 s0, s1;
            load_half_scales(kind, block, h0 + h, &s0, &s1);
            for (int t = 0; t < T; t++) {
                size_t at = (size_t)(m0 + t) * nb + b;
                __m256 dx = _mm256_set1_ps(in->dx[at]);
                acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t][0]), _mm256_mul_ps(s0, dx), acc[h][t]);
                if (kind == KIND_Q6_K)
                    acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t][1]), _mm256_mul_ps(s1, dx), acc[h][t]);
                else if (kind != KIND_Q8_0 && kind != KIND_Q5_0)
                    acc[h][t] = _mm256_fmadd_ps(s1, _mm256_set1_ps(in->ex[at]), acc[h][t]);
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) _mm256_storeu_ps(y + (size_t)(m0 + t) * n_out + (h0 + h) * HALF, acc[h][t]);
}

#define HALF_CASE(T) case T: half_tile(kind, group, h, 1, in, y, n_out, n_in, m0, T); break;
#define DEFINE_GROUP(NAME, KIND)                                                                     \
    static void NAME(const uint8_t *group, size_t stride, int pair, const Quantised *in, float *y,  \
                     int M, int n_out, int n_in) {                                                   \
        const int kind = KIND;                                                                       \
        (void)stride, (void)pair;                                                                    \
        switch (M) { /* one or two rows: both halves in one walk (half_tile's comment says why) */   \
            case 1: half_tile(kind, group, 0, 2, in, y, n_out, n_in, 0, 1); return;                  \
            case 2: half_tile(kind, group, 0, 2, in, y, n_out, n_in, 0, 2); return;                  \
        }                                                                                            \
        for (int m0 = 0; m0 < M; m0 += HALF_TILE)                                                    \
            for (int h = 0; h < 2; h++)                                                              \
                switch (M - m0 < HALF_TILE ? M - m0 : HALF_TILE) {                                   \
                    HALF_CASE(1) HALF_CASE(2) HALF_CASE(3) HALF_CASE(4)                              \
                    HALF_CASE(5) HALF_CASE(6) HALF_CASE(7) HALF_CASE(8)                              \
                }                                                                                    \
    }
#endif

/* One loop of each kind's, for either level's DEFINE_GROUP. */
DEFINE_GROUP(q4_1_group, KIND_Q4_1)
DEFINE_GROUP(q8_0_group, KIND_Q8_0)
DEFINE_GROUP(q4_k_group, KIND_Q4_K)
DEFINE_GROUP(q5_k_group, KIND_Q5_K)
DEFINE_GROUP(q6_k_group, KIND_Q6_K)
DEFINE_GROUP(q5_0_group, KIND_Q5_0)

typedef void (*group_fn)(const uint8_t *, size_t, int, const Quantised *, float *, int, int, int);

/* y [M, n_out] = W x for packed weights (n_out a multiple of 16, n_in of 32), any M >= 1. A pass
 * of up to TILE input rows takes groups one by one (one tile: each weight is unpacked once);
 * longer passes of whole bytes (Q8_0, Q5_K, Q6_K) take them in pairs, which share each broadcast
 * input (VNNI; on AVX2, tiles of HALF_TILE rows a half and no pairs: PAIR_GROUPS). Nibbles stay in
 * single groups, tiles of TILE rows: a pair's tiles of TILE / 2 unpack each weight twice as often,
 * which cost more than the broadcasts saved (16 and 32 rows of Q4_1 took 14% and 7% longer). */
static void run(int kind, group_fn group, const uint8_t *packed, const float *x, float *y, int M, int n_out,
                int n_in, int threads) {
    Quantised in;
    if (!quantised_alloc(&in, M, n_in)) {
        for (size_t i = 0; i < (size_t)M * n_out; i++) y[i] = NAN;  /* no memory: never a silent result */
        quantised_free(&in);
        return;
    }
    int groups = n_out / GROUP, nb = n_in / QK, span = PAIR_GROUPS && M > TILE && !nibble_kind(kind) ? 2 : 1, units = (groups + span - 1) / span;
    size_t stride = (size_t)nb * PACKED_BYTES[kind], blocks = (size_t)M * nb;
    /* A pass of several rows has the threads quantise the input's blocks between them first (each
     * block on its own: the same bits whoever does it); a few blocks take less than the barrier. */
    int shared = threads > 1 && blocks >= SHARED_QUANTISATION;
    if (!shared) quantize_vector(x, 0, blocks, &in);
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        flush_denormals();
        if (shared) {
            int team = omp_get_num_threads(), me = omp_get_thread_num();
            quantize_vector(x, blocks * me / team, blocks * (me + 1) / team, &in);
            _Pragma("omp barrier")
        }
        _Pragma("omp for schedule(static)")
        for (int u = 0; u < units; u++) {
            int g = u * span;
            group(packed + g * stride, stride, g + 1 < groups && span == 2, &in, y + (size_t)g * GROUP, M, n_out, n_in);
        }
    }
    quantised_free(&in);
}

/* The entry points, one per kind: decodekit_q8_q4_1, ..._q8_0, ..._q4_k, ..._q5_k, ..._q6_k, ..._q5_0. */
#define DEFINE_ENTRY(NAME, KIND)                                                                    \
    void decodekit_q8_##NAME(const uint8_t *packed, const float *x, float *y, int M, int n_out, int n_in, \
                             int threads) {                                                          \
        run(KIND, NAME##_group, packed, x, y, M, n_out, n_in, threads);                              \
    }
DEFINE_ENTRY(q4_1, KIND_Q4_1)
DEFINE_ENTRY(q8_0, KIND_Q8_0)
DEFINE_ENTRY(q4_k, KIND_Q4_K)
DEFINE_ENTRY(q5_k, KIND_Q5_K)
DEFINE_ENTRY(q6_k, KIND_Q6_K)
DEFINE_ENTRY(q5_0, KIND_Q5_0)

/* Rows `rows[0..n)` of a packed matrix as float32 weights (out [n][n_in]): s * (u - z) + n, the
 * GGUF dequantisation's arithmetic (its one rounding, where it has one), so each row is bit for bit
 * the file's dequantised row. What an embedding table tied to its output head reads a token from. */
void decodekit_q8_rows(int kind, const uint8_t *packed, const int64_t *rows, int n, int n_out, int n_in, float *out) {
    int nb = n_in / QK, size = PACKED_BYTES[kind], weights = SCALES_AT[kind];
    int zero = kind == KIND_Q8_0 ? 128 : kind == KIND_Q5_0 ? 16 : kind == KIND_Q6_K ? 32 : 0;
    int has_offset = kind == KIND_Q4_1 || kind == KIND_Q4_K || kind == KIND_Q5_K;
    for (int i = 0; i < n; i++) {
        int64_t row = rows[i];
        if (row < 0 || row >= n_out) { /* never read outside the matrix: a NaN row instead */
            for (int k = 0; k < n_in; k++) out[(size_t)i * n_in + k] = NAN;
            continue;
        }
        int g = (int)(row / GROUP), r = (int)(row % GROUP);
        for (int b = 0; b < nb; b++) {
            const uint8_t *block = packed + ((size_t)g * nb + b) * size;
            float s[2], offset = 0.0f;
            if (half_scales(kind)) {
                s[0] = s[1] = half_to_float(block + weights + 2 * r);
                if (kind == KIND_Q4_1) offset = half_to_float(block + weights + 2 * GROUP + 2 * r);
            } else {
                memcpy(&s[0], block + weights + 4 * r, 4);
                memcpy(kind == KIND_Q6_K ? &s[1] : &offset, block + weights + 4 * GROUP + 4 * r, 4);
                if (kind != KIND_Q6_K) s[1] = s[0];
            }
            for (int k = 0; k < QK; k++) {
                int chunk = k / 4, slot = r * 4 + k % 4, u;
                if (nibble_kind(kind)) {
                    u = (block[(chunk % 4) * 64 + slot] >> (chunk < 4 ? 0 : 4)) & 0x0f;
                    if (kind == KIND_Q5_0) u |= ((block[256 + chunk * 8 + slot / 8] >> (slot % 8)) & 1) << 4;
                } else {
                    u = block[chunk * 64 + slot];
                }
                float q = (float)(u - zero);
                out[(size_t)i * n_in + (size_t)b * QK + k] = has_offset ? fmaf(s[k / 16], q, offset) : s[k / 16] * q;
            }
        }
    }
}

/* The scalar reference, on the GGUF blocks as the file has them: the same arithmetic in the same
 * order, one value at a time. Not vectorised: GCC 12 turns its signed-byte dot product into
 * vpdpbusd, which reads the first operand's bytes as unsigned (a wrong result for Q8_0), and a
 * reference should not depend on the instructions it checks anyway. */
__attribute__((optimize("no-tree-vectorize"))) void decodekit_q8_reference(int kind, const uint8_t *w, const float *x, float *y, int M, int n_out, int n_in) {
    int nb = n_in / QK;
    size_t row_bytes = (size_t)(n_in / FILE_WEIGHTS[kind]) * FILE_BYTES[kind];
    Quantised in;
    if (!quantised_alloc(&in, M, n_in)) {
        for (size_t i = 0; i < (size_t)M * n_out; i++) y[i] = NAN;
        quantised_free(&in);
        return;
    }
    quantize_scalar(x, M, n_in, &in);
    for (int m = 0; m < M; m++)
        for (int r = 0; r < n_out; r++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                SubBlock sub;
                decode_sub_block(kind, w + (size_t)r * row_bytes, b, &sub);
                const int8_t *xq = in.q + (size_t)m * n_in + (size_t)b * QK;
                size_t at = (size_t)m * nb + b;
                int32_t half[2] = {0, 0};
                for (int k = 0; k < QK; k++) half[k / 16] += sub.u[k] * xq[k];
                if (kind == KIND_Q6_K) {
                    acc = fmaf((float)(half[0] + in.c0[at]), sub.s[0] * in.dx[at], acc);
                    acc = fmaf((float)(half[1] + in.c1[at]), sub.s[1] * in.dx[at], acc);
                    continue;
                }
                int32_t correction = kind == KIND_Q8_0 ? in.cx[at] : kind == KIND_Q5_0 ? in.cx[at] / 8 : 0;
                acc = fmaf((float)(half[0] + half[1] + correction), sub.s[0] * in.dx[at], acc);
                if (kind != KIND_Q8_0 && kind != KIND_Q5_0) acc = fmaf(sub.n, in.ex[at], acc);
            }
            y[(size_t)m * n_out + r] = acc;
        }
    quantised_free(&in);
}

/* The integer multiply-add peak (`decodekit profile`): `iterations` rounds of 12 independent
 * vpdpbusd per thread, 64 byte products each (AVX2: 8 chains of three vpmaddubsw, 32 each, within
 * its 16 registers). Returns a sum of every result, so that none of them can be left out. */
int64_t decodekit_q8_peak(int64_t iterations, int threads) {
    int64_t total = 0;
    _Pragma("omp parallel num_threads(threads) reduction(+ : total)")
    {
#ifdef __AVX512VNNI__
        const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
        __m512i acc[12];
        for (int j = 0; j < 12; j++) acc[j] = _mm512_setzero_si512();
        for (int64_t i = 0; i < iterations; i++)
            for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
        for (int j = 0; j < 12; j++) total += _mm512_reduce_add_epi32(acc[j]);
#else
        const __m256i a = _mm256_set1_epi8(1);
        __m256i acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_set1_epi8((char)j);
        /* each product reads the last (a dependency the compiler cannot hoist out of the loop) */
        for (int64_t i = 0; i < iterations; i++)
            for (int j = 0; j < 8; j++) acc[j] = _mm256_maddubs_epi16(a, _mm256_maddubs_epi16(a, _mm256_maddubs_epi16(a, acc[j])));
        for (int j = 0; j < 8; j++) {
            int16_t lanes[16];
            _mm256_storeu_si256((__m256i *)lanes, acc[j]);
            for (int l = 0; l < 16; l++) total += lanes[l];
        }
#endif
    }
    return total;
}

/* Whether this CPU has the instructions the kernels above were built with. */
int decodekit_q8_runs_here(void) {
    __builtin_cpu_init();
#ifdef __AVX512VNNI__
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#else
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
}
