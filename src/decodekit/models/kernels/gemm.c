/* Weight-streaming matrix products for decode steps: Y[m] = W X[m] for a few rows X[m].
 *
 * W is row-major [n_out, n_in]; X is [M, n_in] and Y is [M, n_out], all of one dtype (float32 or
 * bfloat16; bfloat16 results are rounded to nearest even from float32 sums). A decode step
 * (M = 1) or a small verification pass reads every weight once and does little arithmetic with
 * it, so its speed is set by how fast weights stream from memory. A few inputs: each thread
 * streams its share of the rows one row at a time, applying each row to all inputs (a single
 * sequential stream is what the prefetchers serve best, asked for a little ahead: ask_ahead); on
 * AVX2, rows interleaved in fours take one or two inputs four or two rows at once (WP_FEW_IN_FOURS).
 * More inputs: on AVX-512, up to 8, two rows at a time against all of them (each GGUF block
 * rebuilt once: four_rows_in_pairs); beyond, blocks of four rows are applied to the inputs four at
 * a time while they sit in L1 (GGUF blocks rebuilt in float32 once a pass for them all:
 * REBUILT_ONCE). Rows are split between threads with OpenMP (inside torch's process this is
 * torch's own OpenMP runtime).
 *
 * bfloat16 uses AVX512-BF16's dot-product instruction: exact products of bfloat16 pairs, summed
 * in float32 (the arithmetic of oneDNN's bfloat16 GEMM, in a different order).
 *
 * Q4_1, Q8_0, Q5_0 and K-quant (Q4_K, Q5_K, Q6_K) weights are GGUF blocks, rebuilt in float32
 * in registers (see below): a decode step reads 4.5 to 8.5 bits a weight instead of 32, with
 * float32 results bit-identical to the float32 kernel on the dequantised weights.
 *
 * Every output is summed in the same order whatever M is (vector lanes of partial sums, then
 * one horizontal sum), so a token's projections in a multi-token pass are bit-identical to
 * those of a one-token step.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "decodekit.h"
#include "gguf.h"
#include "simd.h"

/* Bytes ahead of the weights a step rebuilds that it asks the memory for. On an Intel Xeon
 * (Sapphire Rapids class) the hardware prefetchers alone left a decode step waiting on memory most
 * of its time (docs/BENCHMARKS.md has the figures); a couple of kilobytes ahead, a thread's stream
 * of weights arrives in time. */
#define PREFETCH_AHEAD 2048
static inline void ask_ahead(const void *weights) { _mm_prefetch((const char *)weights + PREFETCH_AHEAD, _MM_HINT_T0); }

/* Each weight format says where row r starts (P_row) and how to load the weights of a row as the
 * vectors its multiply-accumulate takes: P_at fills P_STEP vectors with the weights
 * [i, i + P_STEP * lanes) (a GGUF block's 32 weights are rebuilt together, sharing its scales),
 * P_at_masked one vector for a row's last partial vector. */

/* float32: 16 lanes per vector */
#define f32_LANES 16
#define f32_STEP 1
typedef __mmask16 f32_mask;
static inline f32_mask f32_tail(int n) { return (f32_mask)((1u << n) - 1u); }
static inline __m512 f32_load(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 f32_load_masked(const float *p, f32_mask m) { return _mm512_maskz_loadu_ps(m, p); }
static inline const float *f32_row(const float *w, int r, int n_in) { return w + (size_t)r * n_in; }
static inline void f32_at(const float *row, int i, __m512 *out) { ask_ahead(row + i), out[0] = f32_load(row + i); }
static inline __m512 f32_at_masked(const float *row, int i, f32_mask m) { return f32_load_masked(row + i, m); }

/* A panel of rebuilt weights (REBUILT_ONCE): float32 rows just written, in the first- or
 * second-level cache, read as f32's without asking the memory ahead (there a prefetch a vector
 * only takes load slots from the multiply-adds). */
#define panel_STEP 1
static inline const float *panel_row(const float *w, int r, int n_in) { return f32_row(w, r, n_in); }
static inline void panel_at(const float *row, int i, __m512 *out) { out[0] = f32_load(row + i); }
static inline __m512 panel_at_masked(const float *row, int i, f32_mask m) { return f32_at_masked(row, i, m); }
static inline __m512 f32_mac(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
static inline float f32_out(float s) { return s; }

#ifdef __AVX512BF16__ /* (an AVX2 build has none: decodekit_has_avx512bf16 says so) */
/* bfloat16: 32 values per vector, pairs multiplied and added into 16 float32 lanes */
#define bf16_LANES 32
#define bf16_STEP 1
typedef __mmask32 bf16_mask;
static inline bf16_mask bf16_tail(int n) { return (bf16_mask)((1ull << n) - 1ull); }
static inline __m512i bf16_load(const uint16_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline __m512i bf16_load_masked(const uint16_t *p, bf16_mask m) { return _mm512_maskz_loadu_epi16(m, p); }
static inline const uint16_t *bf16_row(const uint16_t *w, int r, int n_in) { return w + (size_t)r * n_in; }
static inline void bf16_at(const uint16_t *row, int i, __m512i *out) { ask_ahead(row + i), out[0] = bf16_load(row + i); }
static inline __m512i bf16_at_masked(const uint16_t *row, int i, bf16_mask m) { return bf16_load_masked(row + i, m); }
static inline __m512 bf16_mac(__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
/* float32 -> bfloat16, round to nearest even (torch's conversion; NaN stays NaN) */
static inline uint16_t bf16_out(float s) {
    union { float f; uint32_t u; } v = {s};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
#endif

/* GGUF blocks of 32 weights, rebuilt in float32 exactly as GGUF dequantisation computes them
 * (gguf-py, ggml): Q4_1 {fp16 d, fp16 m, 16 bytes: weight j in the low nibble of byte j, weight
 * j + 16 in the high nibble} -> d * q + m; Q8_0 {fp16 d, int8 q[32]} -> d * q. d * q is exact in
 * float32 (an 11-bit by 4- or 8-bit product), so one fused multiply-add gives the dequantised
 * float32 weight bit for bit, and the float32 kernel's sums follow. A block is one step of two
 * float32 vectors (weights 0-15, then 16-31: the float32 kernel's order). */
#define q4_1_STEP 2
#define q8_0_STEP 2

static inline const uint8_t *q4_1_row(const uint8_t *w, int r, int n_in) { return w + (size_t)r * (n_in / 32) * Q4_1_BYTES; }
static inline void q4_1_block(const uint8_t *block, __m512 *out) {
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 4)));
    int32_t dm; /* d and m, the block's two float16 values, converted together */
    memcpy(&dm, block, 4);
    __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    __m512 d = _mm512_broadcastss_ps(both), m = _mm512_broadcastss_ps(_mm_movehdup_ps(both));
    out[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0f))), d, m);
    out[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d, m);
}
static inline void q4_1_at(const uint8_t *row, int i, __m512 *out) {
    const uint8_t *block = row + (size_t)(i / 32) * Q4_1_BYTES;
    ask_ahead(block), q4_1_block(block, out);
}

static inline const uint8_t *q8_0_row(const uint8_t *w, int r, int n_in) { return w + (size_t)r * (n_in / 32) * Q8_0_BYTES; }
static inline void q8_0_block(const uint8_t *block, __m512 *out) {
    __m512 d = _mm512_set1_ps(half_to_float(block));
    out[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 2)))), d);
    out[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 18)))), d);
}
static inline void q8_0_at(const uint8_t *row, int i, __m512 *out) {
    const uint8_t *block = row + (size_t)(i / 32) * Q8_0_BYTES;
    ask_ahead(block), q8_0_block(block, out);
}

/* The same blocks with rows interleaved in fours, block by block: [n_out / 4][n_in / 32][4][block]
 * (gguf_blocks.BlockMatrix.interleaved; n_out a multiple of 4). Four rows read side by side are then
 * one sequential stream, so every pass takes the four-row path and shares its input loads. */
#define q4_1x4_STEP 2
#define q8_0x4_STEP 2
static inline const uint8_t *q4_1x4_row(const uint8_t *w, int r, int n_in) { return w + ((size_t)(r / 4) * (n_in / 32) * 4 + r % 4) * Q4_1_BYTES; }
static inline void q4_1x4_at(const uint8_t *row, int i, __m512 *out) {
    const uint8_t *block = row + (size_t)(i / 32) * 4 * Q4_1_BYTES;
    ask_ahead(block), q4_1_block(block, out);
}
static inline const uint8_t *q8_0x4_row(const uint8_t *w, int r, int n_in) { return w + ((size_t)(r / 4) * (n_in / 32) * 4 + r % 4) * Q8_0_BYTES; }
static inline void q8_0x4_at(const uint8_t *row, int i, __m512 *out) {
    const uint8_t *block = row + (size_t)(i / 32) * 4 * Q8_0_BYTES;
    ask_ahead(block), q8_0_block(block, out);
}

/* Q5_0 {fp16 d, 32 high bits, 16 bytes of nibbles as Q4_1's} -> d * (q - 16), q = nibble + 16 * bit;
 * exact in float32, as Q8_0's. */
#define q5_0_STEP 2
static inline const uint8_t *q5_0_row(const uint8_t *w, int r, int n_in) { return w + (size_t)r * (n_in / 32) * Q5_0_BYTES; }
static inline void q5_0_block_at(const uint8_t *block, __m512 *out) {
    uint32_t high;
    memcpy(&high, block + 2, 4);
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 6)));
    __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), bits = _mm512_set1_epi32((int)high);
    __m512i one = _mm512_set1_epi32(1), sixteen = _mm512_set1_epi32(16), low = _mm512_set1_epi32(0x0f);
    __m512i h0 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(bits, lanes), one), 4);
    __m512i h1 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(bits, _mm512_add_epi32(lanes, sixteen)), one), 4);
    __m512 d = _mm512_set1_ps(half_to_float(block));
    __m512i q0 = _mm512_sub_epi32(_mm512_or_si512(_mm512_and_si512(bytes, low), h0), sixteen);
    __m512i q1 = _mm512_sub_epi32(_mm512_or_si512(_mm512_srli_epi32(bytes, 4), h1), sixteen);
    out[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d);
    out[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d);
}

/* K-quants: super-blocks of 256 weights; one step rebuilds the sub-block of 32 that holds weight i.
 * Q4_K {fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minima, 128 bytes: sub-blocks 2p and
 * 2p + 1 in the low and high nibbles of bytes 32p .. 32p + 31} -> (d * s) * q - dmin * m: the
 * product is exact, so one fused multiply-add rounds once, as the reference's subtraction does.
 * Q5_K: the same with a fifth bit per weight (bit j of byte l of 32 bytes, for sub-block j).
 * Q6_K {128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 weights),
 * fp16 d} -> (d * s) * (q - 32): both products exact. */
#define q4_k_STEP 2
#define q5_k_STEP 2
#define q6_k_STEP 2
static inline const uint8_t *q4_k_row(const uint8_t *w, int r, int n_in) { return w + (size_t)r * (n_in / 256) * Q4_K_BYTES; }
static inline const uint8_t *q5_k_row(const uint8_t *w, int r, int n_in) { return w + (size_t)r * (n_in / 256) * Q5_K_BYTES; }
static inline const uint8_t *q6_k_row(const uint8_t *w, int r, int n_in) { return w + (size_t)r * (n_in / 256) * Q6_K_BYTES; }

/* 32 weights q (as int32 in two vectors) -> (d * s) * q - dmin * m, for sub-block j of a Q4_K / Q5_K block. */
static inline void k_rebuild(const uint8_t *block, int j, __m512i q0, __m512i q1, __m512 *out) {
    int scale, min;
    k_scale_min(block + 4, j, &scale, &min);
    __m512 d = _mm512_set1_ps(half_to_float(block) * (float)scale), m = _mm512_set1_ps(-(half_to_float(block + 2) * (float)min));
    out[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), d, m);
    out[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d, m);
}

static inline __m512i nibbles(const uint8_t *bytes, int high) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    return _mm512_and_si512(high ? _mm512_srli_epi32(v, 4) : v, _mm512_set1_epi32(0x0f));
}

static inline void q4_k_block_at(const uint8_t *block, int i, __m512 *out) {
    int j = (i % 256) / 32;
    const uint8_t *qs = block + 16 + 32 * (j / 2);
    k_rebuild(block, j, nibbles(qs, j & 1), nibbles(qs + 16, j & 1), out);
}

static inline __m512i fifth_bits(const uint8_t *qh, int j) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
    return _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v, j), _mm512_set1_epi32(1)), 4);
}

static inline void q5_k_block_at(const uint8_t *block, int i, __m512 *out) {
    int j = (i % 256) / 32;
    const uint8_t *qh = block + 16, *qs = block + 48 + 32 * (j / 2);
    k_rebuild(block, j, _mm512_or_si512(nibbles(qs, j & 1), fifth_bits(qh, j)),
              _mm512_or_si512(nibbles(qs + 16, j & 1), fifth_bits(qh + 16, j)), out);
}

static inline void q6_k_block_at(const uint8_t *block, int i, __m512 *out) {
    int c = (i % 256) / 32, h = c / 4, u = c % 4;  /* chunk c: half h, quarter u of it */
    const uint8_t *ql = block + 64 * h + 32 * (u & 1), *qh = block + 128 + 32 * h;
    const int8_t *scales = (const int8_t *)(block + 192) + 2 * c;
    float d = half_to_float(block + 208);
    for (int s = 0; s < 2; s++) {
        __m512i high = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * s)));
        high = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * u), _mm512_set1_epi32(3)), 4);
        __m512i q = _mm512_sub_epi32(_mm512_or_si512(nibbles(ql + 16 * s, u >= 2), high), _mm512_set1_epi32(32));
        out[s] = _mm512_mul_ps(_mm512_set1_ps(d * (float)scales[s]), _mm512_cvtepi32_ps(q));
    }
}

/* Each of those formats read from rows as stored (a row's blocks one after another), and from rows
 * interleaved in fours block by block, as Q4_1x4 and Q8_0x4 (a K-quant's block is its 256 weights). */
#define DEFINE_FILE_FORMAT(F, BYTES, WEIGHTS, CALL)                                                 \
    static inline void F##_at(const uint8_t *row, int i, __m512 *out) {                            \
        const uint8_t *block = row + (size_t)(i / WEIGHTS) * BYTES;                                \
        ask_ahead(block);                                                                          \
        CALL;                                                                                      \
    }                                                                                              \
    static inline const uint8_t *F##x4_row(const uint8_t *w, int r, int n_in) {                    \
        return w + ((size_t)(r / 4) * (n_in / WEIGHTS) * 4 + r % 4) * BYTES;                       \
    }                                                                                              \
    static inline void F##x4_at(const uint8_t *row, int i, __m512 *out) {                          \
        const uint8_t *block = row + (size_t)(i / WEIGHTS) * 4 * BYTES;                            \
        ask_ahead(block);                                                                          \
        CALL;                                                                                      \
    }
DEFINE_FILE_FORMAT(q5_0, Q5_0_BYTES, SMALL_BLOCK_WEIGHTS, q5_0_block_at(block, out))
DEFINE_FILE_FORMAT(q4_k, Q4_K_BYTES, K_BLOCK_WEIGHTS, q4_k_block_at(block, i, out))
DEFINE_FILE_FORMAT(q5_k, Q5_K_BYTES, K_BLOCK_WEIGHTS, q5_k_block_at(block, i, out))
DEFINE_FILE_FORMAT(q6_k, Q6_K_BYTES, K_BLOCK_WEIGHTS, q6_k_block_at(block, i, out))
#define q5_0x4_STEP 2
#define q4_kx4_STEP 2
#define q5_kx4_STEP 2
#define q6_kx4_STEP 2

/* A block format's one-vector load for a row's last partial vector: the half of its block that
 * holds weight i, masked (rows of whole blocks never need it; it is defined to be correct). */
#define DEFINE_BLOCK_AT_MASKED(WP)                                                                 \
    static inline __m512 WP##_at_masked(const uint8_t *row, int i, f32_mask mask) {               \
        __m512 both[2];                                                                            \
        WP##_at(row, i & ~31, both);                                                               \
        return _mm512_maskz_mov_ps(mask, both[(i & 16) != 0]);                                    \
    }
DEFINE_BLOCK_AT_MASKED(q4_1)
DEFINE_BLOCK_AT_MASKED(q8_0)
DEFINE_BLOCK_AT_MASKED(q4_1x4)
DEFINE_BLOCK_AT_MASKED(q8_0x4)
DEFINE_BLOCK_AT_MASKED(q5_0)
DEFINE_BLOCK_AT_MASKED(q4_k)
DEFINE_BLOCK_AT_MASKED(q5_k)
DEFINE_BLOCK_AT_MASKED(q6_k)
DEFINE_BLOCK_AT_MASKED(q5_0x4)
DEFINE_BLOCK_AT_MASKED(q4_kx4)
DEFINE_BLOCK_AT_MASKED(q5_kx4)
DEFINE_BLOCK_AT_MASKED(q6_kx4)

/* A pass of at most WP_SINGLE_ROW_MAX inputs streams the weights one row at a time (but see
 * WP_FEW_IN_FOURS below); a longer one, four rows side by side against groups of inputs (their
 * shared input loads pay off with enough inputs). The cut-offs are where the two met, per format,
 * measured with SmolLM2's matrices at the AVX-512 level (docs/BENCHMARKS.md); at the AVX2 level,
 * whose single-row blocks take at most four inputs, they are capped at four (AT_MOST_SINGLE). A
 * block of BLOCK_ROWS rows by BLOCK_INPUTS inputs keeps its sums in registers: 16 of AVX-512's 32.
 * AVX2 has 16 registers of half the width (an AVX-512 vector is two of them here): its blocks are
 * four rows by one input, which measured fastest there (docs/BENCHMARKS.md). Each sum runs in
 * element order whatever the block, so the bits are the same at both levels. */
#ifdef __AVX512F__
#define SINGLE_ROW_MAX 8 /* the largest of the formats' cut-offs */
#define BLOCK_ROWS 4
#define BLOCK_INPUTS 4
#define X4_SINGLE_ROW_MAX 0 /* rows interleaved in fours: always four at a time */
#define X4_FEW_IN_FOURS 0
#define IN_PAIRS_MAX 8 /* up to 8 inputs, a group of four rows is taken two rows at a time (four_rows_in_pairs) */
#else
#define SINGLE_ROW_MAX 4
#define BLOCK_ROWS 4
#define BLOCK_INPUTS 1
#define X4_SINGLE_ROW_MAX 4 /* (blocks of one input would rebuild the weights for each) */
#define X4_FEW_IN_FOURS 2 /* one input: four rows at once; two inputs: two rows at once, twice (rows_at_once) */
#define IN_PAIRS_MAX 0
#endif
#define AT_MOST_SINGLE(n) ((n) < SINGLE_ROW_MAX ? (n) : SINGLE_ROW_MAX)
#define f32_SINGLE_ROW_MAX AT_MOST_SINGLE(4)
#define panel_SINGLE_ROW_MAX f32_SINGLE_ROW_MAX
#define bf16_SINGLE_ROW_MAX AT_MOST_SINGLE(8)
#define q4_1_SINGLE_ROW_MAX AT_MOST_SINGLE(8)
#define q8_0_SINGLE_ROW_MAX AT_MOST_SINGLE(8)
#define q4_1x4_SINGLE_ROW_MAX X4_SINGLE_ROW_MAX
#define q8_0x4_SINGLE_ROW_MAX X4_SINGLE_ROW_MAX
#define q5_0_SINGLE_ROW_MAX AT_MOST_SINGLE(8)
#define q4_k_SINGLE_ROW_MAX AT_MOST_SINGLE(8)
#define q5_k_SINGLE_ROW_MAX AT_MOST_SINGLE(8)
#define q6_k_SINGLE_ROW_MAX AT_MOST_SINGLE(8)
#define q5_0x4_SINGLE_ROW_MAX X4_SINGLE_ROW_MAX
#define q4_kx4_SINGLE_ROW_MAX X4_SINGLE_ROW_MAX
#define q5_kx4_SINGLE_ROW_MAX X4_SINGLE_ROW_MAX
#define q6_kx4_SINGLE_ROW_MAX X4_SINGLE_ROW_MAX
/* Inputs up to which a format's four rows of a group are taken at once (rows_at_once), at most two
 * (its sums' registers): only rows interleaved in fours, which are one stream however they are
 * taken (four rows as stored would be four streams), and whose rows are whole blocks (rows_at_once
 * has no masked tail). */
#define f32_FEW_IN_FOURS 0
#define panel_FEW_IN_FOURS 0
#define bf16_FEW_IN_FOURS 0
#define q4_1_FEW_IN_FOURS 0
#define q8_0_FEW_IN_FOURS 0
#define q5_0_FEW_IN_FOURS 0
#define q4_k_FEW_IN_FOURS 0
#define q5_k_FEW_IN_FOURS 0
#define q6_k_FEW_IN_FOURS 0
#define q4_1x4_FEW_IN_FOURS X4_FEW_IN_FOURS
#define q8_0x4_FEW_IN_FOURS X4_FEW_IN_FOURS
#define q5_0x4_FEW_IN_FOURS X4_FEW_IN_FOURS
#define q4_kx4_FEW_IN_FOURS X4_FEW_IN_FOURS
#define q5_kx4_FEW_IN_FOURS X4_FEW_IN_FOURS
#define q6_kx4_FEW_IN_FOURS X4_FEW_IN_FOURS
/* Inputs from which a block format's weights are rebuilt once a pass (REBUILT_ONCE): two groups of
 * four. Formats that stream a row at a time up to their SINGLE_ROW_MAX keep doing so below it. */
#define REBUILT_ROWS 5
#define BLOCK_CASE(NAME, R, M) case M: NAME##_block(wr, x, y, n_in, n_out, R, M); break;
#if SINGLE_ROW_MAX == 8
#define WIDE_ROW_CASES(NAME) BLOCK_CASE(NAME, 1, 5) BLOCK_CASE(NAME, 1, 6) BLOCK_CASE(NAME, 1, 7) BLOCK_CASE(NAME, 1, 8)
#define PAIR_CASE(NAME, M) case M: NAME##_block(wr, x, y0, n_in, n_out, 2, M); break;
#define PAIR_CASES(NAME) PAIR_CASE(NAME, 5) PAIR_CASE(NAME, 6) PAIR_CASE(NAME, 7) PAIR_CASE(NAME, 8)
#else
#define WIDE_ROW_CASES(NAME)
#define PAIR_CASES(NAME)
#endif

/* NAME: weights of type WT in format WP, inputs and outputs of type T with arithmetic P; ENTRY
 * defines the entry point NAME (STREAMED or REBUILT_ONCE, below). */
#define DEFINE_KERNEL(NAME, WT, WP, T, VEC, P, OUT, ENTRY)                                         \
    /* Rows [0, R) of w against inputs x[0, M), R * M <= 16 (both constants once inlined). */      \
    static inline __attribute__((always_inline)) void NAME##_block(                               \
        const WT *w, const T *x, OUT *y, int n_in, int n_out, const int R, const int M) {          \
        __m512 acc[4][SINGLE_ROW_MAX];                                                             \
        VEC wv[4][WP##_STEP];                                                                      \
        const WT *rows[4];                                                                         \
        for (int r = 0; r < R; r++) rows[r] = WP##_row(w, r, n_in);                                \
        for (int r = 0; r < R; r++)                                                                \
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();                           \
        int i = 0;                                                                                 \
        for (; i + WP##_STEP * P##_LANES <= n_in; i += WP##_STEP * P##_LANES) {                    \
            for (int r = 0; r < R; r++) WP##_at(rows[r], i, wv[r]);                                \
            for (int s = 0; s < WP##_STEP; s++) /* in element order, as one vector a step */       \
                for (int m = 0; m < M; m++) {                                                      \
                    VEC xv = P##_load(x + (size_t)m * n_in + i + s * P##_LANES);                   \
                    for (int r = 0; r < R; r++) acc[r][m] = P##_mac(acc[r][m], wv[r][s], xv);      \
                }                                                                                  \
        }                                                                                          \
        for (; i < n_in; i += P##_LANES) { /* what is left: masked loads (zeros add nothing) */    \
            P##_mask mask = P##_tail(n_in - i < P##_LANES ? n_in - i : P##_LANES);                 \
            for (int r = 0; r < R; r++) wv[r][0] = WP##_at_masked(rows[r], i, mask);               \
            for (int m = 0; m < M; m++) {                                                          \
                VEC xv = P##_load_masked(x + (size_t)m * n_in + i, mask);                          \
                for (int r = 0; r < R; r++) acc[r][m] = P##_mac(acc[r][m], wv[r][0], xv);          \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int m = 0; m < M; m++) y[(size_t)m * n_out + r] = P##_out(_mm512_reduce_add_ps(acc[r][m])); \
    }                                                                                              \
                                                                                                   \
    /* Row ``row`` of W against all M <= SINGLE_ROW_MAX inputs. */                                 \
    static void NAME##_row(const WT *w, const T *x, OUT *y, int n_in, int n_out, int row, int M) {  \
        const WT *wr = WP##_row(w, row, n_in);                                                     \
        y += row;                                                                                  \
        switch (M) {                                                                               \
            BLOCK_CASE(NAME, 1, 1) BLOCK_CASE(NAME, 1, 2) BLOCK_CASE(NAME, 1, 3) BLOCK_CASE(NAME, 1, 4) \
            WIDE_ROW_CASES(NAME)                                                                   \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* Rows [row, row + 4) of W against 5 to IN_PAIRS_MAX inputs, two rows by all the inputs at     \
     * a time: each weight is rebuilt once for them all (four_rows rebuilds it for every four       \
     * inputs, REBUILT_ONCE writes it to a panel and reads it back), and the 2 x M sums take at     \
     * most 16 of AVX-512's 32 registers. */                                                        \
    static void NAME##_four_rows_in_pairs(const WT *w, const T *x, OUT *y, int n_in, int n_out, int row, int M) { \
        for (int r0 = 0; r0 < 4; r0 += 2) {                                                        \
            const WT *wr = WP##_row(w, row + r0, n_in);                                            \
            OUT *y0 = y + row + r0;                                                                \
            switch (M) {                                                                           \
                PAIR_CASES(NAME)                                                                   \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* Rows [row, row + 4) of W against all M inputs, in blocks of BLOCK_ROWS by BLOCK_INPUTS. */ \
    static void NAME##_four_rows(const WT *w, const T *x, OUT *y, int n_in, int n_out, int row, int M) { \
        for (int r0 = 0; r0 < 4; r0 += BLOCK_ROWS) {                                               \
            const WT *wr = WP##_row(w, row + r0, n_in);                                            \
            for (int m0 = 0; m0 < M; m0 += BLOCK_INPUTS) {                                         \
                const T *xm = x + (size_t)m0 * n_in;                                               \
                OUT *y0 = y + (size_t)m0 * n_out + row + r0;                                       \
                switch (M - m0 < BLOCK_INPUTS ? M - m0 : BLOCK_INPUTS) {                           \
                    case 1: NAME##_block(wr, xm, y0, n_in, n_out, BLOCK_ROWS, 1); break;           \
                    case 2: NAME##_block(wr, xm, y0, n_in, n_out, BLOCK_ROWS, 2); break;           \
                    case 3: NAME##_block(wr, xm, y0, n_in, n_out, BLOCK_ROWS, 3); break;           \
                    default: NAME##_block(wr, xm, y0, n_in, n_out, BLOCK_ROWS, BLOCK_INPUTS); break; \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* Rows [row, row + R) of W against M inputs (R * M <= 4), each row's weights rebuilt and      \
     * applied before the next row's: the R * M sums are independent chains of multiply-adds (one  \
     * row's alone would wait on each add's latency), and they and one row's weights fit AVX2's 16 \
     * registers (_block holds all its rows' weights at once). Each sum in element order, as       \
     * _block's: the same bits. */                                                                 \
    static inline __attribute__((always_inline)) void NAME##_rows_at_once(                        \
        const WT *w, const T *x, OUT *y, int n_in, int n_out, int row, const int R, const int M) { \
        __m512 acc[4][2]; /* R * M <= 4: (4, 1) or (2, 2) */                                      \
        const WT *rows[4];                                                                         \
        for (int r = 0; r < R; r++) {                                                              \
            rows[r] = WP##_row(w, row + r, n_in);                                                  \
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();                           \
        }                                                                                          \
        for (int i = 0; i < n_in; i += WP##_STEP * P##_LANES) /* whole blocks: no partial step */ \
            for (int r = 0; r < R; r++) {                                                          \
                VEC wv[WP##_STEP];                                                                 \
                WP##_at(rows[r], i, wv);                                                           \
                for (int s = 0; s < WP##_STEP; s++)                                                \
                    for (int m = 0; m < M; m++)                                                    \
                        acc[r][m] = P##_mac(acc[r][m], wv[s], P##_load(x + (size_t)m * n_in + i + s * P##_LANES)); \
            }                                                                                      \
        for (int r = 0; r < R; r++)                                                                \
            for (int m = 0; m < M; m++) y[(size_t)m * n_out + row + r] = P##_out(_mm512_reduce_add_ps(acc[r][m])); \
    }                                                                                              \
                                                                                                   \
    /* Rows [row, row + 4) against one input (four rows at once) or two (two rows at once, twice); \
     * no inputs, nothing. */                                                                      \
    static void NAME##_four_rows_few_inputs(const WT *w, const T *x, OUT *y, int n_in, int n_out, int row, int M) { \
        if (M == 1) {                                                                              \
            NAME##_rows_at_once(w, x, y, n_in, n_out, row, 4, 1);                                  \
        } else if (M == 2) {                                                                       \
            NAME##_rows_at_once(w, x, y, n_in, n_out, row, 2, 2);                                  \
            NAME##_rows_at_once(w, x, y, n_in, n_out, row + 2, 2, 2);                              \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* The rows past the last four (n_out % 4 of them), against all M inputs. */                   \
    static void NAME##_last_rows(const WT *w, const T *x, OUT *y, int M, int n_out, int n_in) {     \
        for (int r = n_out / 4 * 4; r < n_out; r++)                                                \
            for (int m0 = 0; m0 < M; m0 += SINGLE_ROW_MAX)                                         \
                NAME##_row(w, x + (size_t)m0 * n_in, y + (size_t)m0 * n_out, n_in, n_out, r,       \
                           M - m0 < SINGLE_ROW_MAX ? M - m0 : SINGLE_ROW_MAX);                     \
    }                                                                                              \
                                                                                                   \
    /* The whole product, rebuilding the weights for every four inputs. */                         \
    static void NAME##_streamed(const WT *w, const T *x, OUT *y, int M, int n_out, int n_in, int threads) { \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)")                              \
        {                                                                                          \
            flush_denormals();                                                                     \
            if (M <= WP##_FEW_IN_FOURS) {                                                          \
                _Pragma("omp for schedule(static)")                                                \
                for (int b = 0; b < n_out / 4; b++) NAME##_four_rows_few_inputs(w, x, y, n_in, n_out, 4 * b, M); \
            } else if (M <= WP##_SINGLE_ROW_MAX) {                                                 \
                _Pragma("omp for schedule(static)")                                                \
                for (int r = 0; r < n_out; r++) NAME##_row(w, x, y, n_in, n_out, r, M);            \
            } else if (M > BLOCK_INPUTS && M <= IN_PAIRS_MAX) {                                 \
                _Pragma("omp for schedule(static)")                                                \
                for (int b = 0; b < n_out / 4; b++) NAME##_four_rows_in_pairs(w, x, y, n_in, n_out, 4 * b, M); \
            } else {                                                                               \
                _Pragma("omp for schedule(static)")                                                \
                for (int b = 0; b < n_out / 4; b++) NAME##_four_rows(w, x, y, n_in, n_out, 4 * b, M); \
            }                                                                                      \
        }                                                                                          \
        if (M > WP##_SINGLE_ROW_MAX || M <= WP##_FEW_IN_FOURS) NAME##_last_rows(w, x, y, M, n_out, n_in); \
    }                                                                                              \
    ENTRY(NAME, WT, WP, T, OUT)

/* No entry point: the kernel's pieces, for REBUILT_ONCE's panels (decodekit_gemm_panel_four_rows). */
#define PIECES_ONLY(NAME, WT, WP, T, OUT)

/* The entry point of formats that need no rebuilding (float32, bfloat16). */
#define STREAMED(NAME, WT, WP, T, OUT)                                                             \
    void NAME(const WT *w, const T *x, OUT *y, int M, int n_out, int n_in, int threads) {          \
        NAME##_streamed(w, x, y, M, n_out, n_in, threads);                                         \
    }

/* The entry point of the block formats: from REBUILT_ROWS inputs on, each thread rebuilds four rows
 * of weights at a time into float32 once (`panel`, 4 x n_in, in L1 or L2) and applies them to all
 * M inputs with the float32 kernel, instead of rebuilding them for every four inputs. The same
 * weights (the same rebuilt bits) and the same sums in the same order: bit for bit what streaming
 * gives, in a pass of any size (a test compares the two). */
#define REBUILT_ONCE(NAME, WT, WP, T, OUT)                                                         \
    static void NAME##_rebuilt(const uint8_t *w, const float *x, float *y, int n_in, int n_out, int row, int M, \
                               float *panel) {                                                     \
        for (int r = 0; r < 4; r++) {                                                              \
            const uint8_t *wr = WP##_row(w, row + r, n_in);                                        \
            for (int i = 0; i < n_in; i += WP##_STEP * 16) {                                       \
                __m512 v[WP##_STEP];                                                               \
                WP##_at(wr, i, v);                                                                 \
                for (int s = 0; s < WP##_STEP; s++) _mm512_store_ps(panel + (size_t)r * n_in + i + 16 * s, v[s]); \
            }                                                                                      \
        }                                                                                          \
        decodekit_gemm_panel_four_rows(panel, x, y + row, n_in, n_out, 0, M);                      \
    }                                                                                              \
                                                                                                   \
    void NAME(const WT *w, const T *x, OUT *y, int M, int n_out, int n_in, int threads) {          \
        if (M < REBUILT_ROWS || M <= WP##_SINGLE_ROW_MAX || M <= IN_PAIRS_MAX) {                   \
            NAME##_streamed(w, x, y, M, n_out, n_in, threads);                                     \
            return;                                                                                \
        }                                                                                          \
        int failed = 0;                                                                            \
        _Pragma("omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)")        \
        {                                                                                          \
            flush_denormals();                                                                     \
            float *panel = aligned_alloc(64, sizeof(float) * 4 * (size_t)n_in);                    \
            failed = panel == NULL;                                                                \
            _Pragma("omp for schedule(static)")                                                    \
            for (int b = 0; b < n_out / 4; b++)                                                    \
                if (panel) NAME##_rebuilt(w, x, y, n_in, n_out, 4 * b, M, panel);                  \
            free(panel);                                                                           \
        }                                                                                          \
        if (failed) { /* no memory: the slower way */                                              \
            NAME##_streamed(w, x, y, M, n_out, n_in, threads);                                     \
            return;                                                                                \
        }                                                                                          \
        NAME##_last_rows(w, x, y, M, n_out, n_in);                                                 \
    }

DEFINE_KERNEL(decodekit_gemm_f32, float, f32, float, __m512, f32, float, STREAMED)
DEFINE_KERNEL(decodekit_gemm_panel, float, panel, float, __m512, f32, float, PIECES_ONLY)
#ifdef __AVX512BF16__
DEFINE_KERNEL(decodekit_gemm_bf16, uint16_t, bf16, uint16_t, __m512i, bf16, uint16_t, STREAMED)
#endif
DEFINE_KERNEL(decodekit_gemm_q4_1, uint8_t, q4_1, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q8_0, uint8_t, q8_0, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q4_1x4, uint8_t, q4_1x4, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q8_0x4, uint8_t, q8_0x4, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q5_0, uint8_t, q5_0, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q4_k, uint8_t, q4_k, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q5_k, uint8_t, q5_k, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q6_k, uint8_t, q6_k, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q5_0x4, uint8_t, q5_0x4, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q4_kx4, uint8_t, q4_kx4, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q5_kx4, uint8_t, q5_kx4, float, __m512, f32, float, REBUILT_ONCE)
DEFINE_KERNEL(decodekit_gemm_q6_kx4, uint8_t, q6_kx4, float, __m512, f32, float, REBUILT_ONCE)

/* Whether this CPU runs the bfloat16 kernel (the float32 one runs wherever this library was built for). */
int decodekit_has_avx512bf16(void) {
#ifdef __AVX512BF16__
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}
