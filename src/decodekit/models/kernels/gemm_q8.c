/* The `fast` numerics: GGUF Q4_1 / Q8_0 weight blocks times inputs quantised to 8 bits, with
 * integer dot products (AVX512-VNNI's vpdpbusd: 64 products of an unsigned and a signed byte,
 * summed four by four into 16 int32 lanes, per instruction).
 *
 * Inputs. Each input row is quantised per block of 32 values as llama.cpp's Q8_1 does:
 * dx = max|x| / 127, qx = nearest integer to x * (1 / dx), sx = the block's sum of qx.
 *
 * Weights are repacked once (decodekit_q8_pack) in groups of 16 output rows: for each block of
 * 32 inputs, the 16 rows' 4-byte slices k = 4g..4g+3 side by side in one 64-byte vector, so one
 * vpdpbusd multiplies 16 rows by 4 inputs of one input row (broadcast) with no horizontal sums.
 * A Q4_1 weight d * q + m (q in 0..15) is the unsigned operand as it is; a Q8_0 weight d * q
 * (q in -128..127) is stored as q + 128 and the sum corrected by -128 * sx, exactly.
 *
 * Arithmetic, for output row r and input row m (the scalar reference below spells it out, and a
 * test compares the vector kernel with it bit for bit):
 *     acc = 0;  for each block b:  acc = fma((float) isum_b, dw_b * dx_b, acc)
 *                                   acc = fma(mw_b, dx_b * (float) sx_b, acc)     (Q4_1 only)
 *     y = acc
 * where isum_b = sum_k q_k qx_k is exact in int32. Every (r, m) pair is computed alone, in that
 * order, whatever else is in the pass, so a token's logits are the same in a plain step, in a
 * verification tree, in a batch, and in prefill. Groups of rows are split between threads.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define GROUP 16   /* output rows side by side in the packed layout */
#define TILE 8     /* input rows a group's unpacked weights are used for before they are rebuilt */

/* GGUF block layouts: Q4_1 {fp16 d, fp16 m, 16 bytes: weight j in the low nibble of byte j,
 * weight j + 16 in the high one} (20 bytes); Q8_0 {fp16 d, int8 q[32]} (34 bytes). */
#define Q4_1_BYTES 20
#define Q8_0_BYTES 34
/* Packed per group and block: Q4_1 {4 x 64 bytes of nibble pairs, 16 fp16 d, 16 fp16 m};
 * Q8_0 {8 x 64 bytes of q + 128, 16 fp16 d}. */
#define Q4_1_PACKED (4 * 64 + 2 * GROUP * 2)
#define Q8_0_PACKED (8 * 64 + GROUP * 2)

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline int q4_1_weight(const uint8_t *block, int k) {
    return k < 16 ? block[4 + k] & 0x0f : block[4 + k - 16] >> 4;
}

/* Inputs quantised: q [M][n_in] int8; per row and block, dx (scale), ex = dx * sx (the Q4_1
 * offset's factor) and cx = -128 * sx (the Q8_0 correction). */
typedef struct {
    int8_t *q;
    float *dx, *ex;
    int32_t *cx;
} Quantised;

static int quantised_alloc(Quantised *in, int M, int n_in) {
    size_t blocks = (size_t)M * (n_in / QK);
    in->q = aligned_alloc(64, ((size_t)M * n_in + 63) / 64 * 64);
    in->dx = malloc(blocks * sizeof(float));
    in->ex = malloc(blocks * sizeof(float));
    in->cx = malloc(blocks * sizeof(int32_t));
    return in->q && in->dx && in->ex && in->cx;
}

static void quantised_free(Quantised *in) { free(in->q), free(in->dx), free(in->ex), free(in->cx); }

/* One block's scale, or NaN when a value is not finite (its quantised values are then 0: the
 * results come out NaN, never silently finite). */
static void finish_block(Quantised *in, size_t at, float dx, int32_t sx) {
    in->dx[at] = dx;
    in->ex[at] = dx * (float)sx;
    in->cx[at] = -128 * sx;
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
            float dx = amax / 127.0f, inv = dx > 0.0f ? 1.0f / dx : 0.0f;
            int32_t sx = 0;
            for (int j = 0; j < QK; j++) {
                /* clamped: x * inv can round past 127 by an ulp, and must never be converted out of range */
                int v = finite ? (int)nearbyintf(fminf(127.0f, fmaxf(-127.0f, xb[j] * inv))) : 0;
                qb[j] = (int8_t)v;
                sx += v;
            }
            finish_block(in, (size_t)m * nb + b, finite ? dx : NAN, sx);
        }
}

/* The same, 16 values a vector (the conversion rounds to nearest even, as nearbyintf does). */
static void quantize_vector(const float *x, int M, int n_in, Quantised *in) {
    int nb = n_in / QK;
    const __m512 limit = _mm512_set1_ps(127.0f), infinity = _mm512_set1_ps(INFINITY);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)m * n_in + (size_t)b * QK;
            int8_t *qb = in->q + (size_t)m * n_in + (size_t)b * QK;
            __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
            /* not less than infinity, or unordered: infinite or NaN */
            int finite = !(_mm512_cmp_ps_mask(a0, infinity, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(a1, infinity, _CMP_NLT_UQ));
            if (!finite) {
                memset(qb, 0, QK);
                finish_block(in, (size_t)m * nb + b, NAN, 0);
                continue;
            }
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
            float dx = amax / 127.0f, inv = dx > 0.0f ? 1.0f / dx : 0.0f;
            __m512 scale = _mm512_set1_ps(inv);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(limit, _mm512_max_ps(-limit, _mm512_mul_ps(x0, scale))));
            __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(limit, _mm512_max_ps(-limit, _mm512_mul_ps(x1, scale))));
            _mm_storeu_si128((__m128i *)qb, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtepi32_epi8(q1));
            finish_block(in, (size_t)m * nb + b, dx, _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
        }
}

/* Repack GGUF blocks [n_out][n_in / 32] (n_out a multiple of 16) into the kernel's layout. */
void decodekit_q8_pack(int kind, const uint8_t *w, uint8_t *packed, int n_out, int n_in) {
    int nb = n_in / QK, bytes = kind == 0 ? Q4_1_BYTES : Q8_0_BYTES, size = kind == 0 ? Q4_1_PACKED : Q8_0_PACKED;
    for (int g = 0; g < n_out / GROUP; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *out = packed + ((size_t)g * nb + b) * size;
            for (int r = 0; r < GROUP; r++) {
                const uint8_t *block = w + ((size_t)(g * GROUP + r) * nb + b) * bytes;
                for (int k = 0; k < QK; k++) {
                    int chunk = k / 4, slot = r * 4 + k % 4;
                    if (kind == 0) {
                        uint8_t q = (uint8_t)q4_1_weight(block, k);
                        if (chunk < 4) out[chunk * 64 + slot] = q;  /* k < 16: low nibble */
                        else out[(chunk - 4) * 64 + slot] |= (uint8_t)(q << 4);
                    } else {
                        out[chunk * 64 + slot] = (uint8_t)((int8_t)block[2 + k] + 128);
                    }
                }
                memcpy(out + (kind == 0 ? 256 : 512) + 2 * r, block, 2);           /* d */
                if (kind == 0) memcpy(out + 256 + 2 * GROUP + 2 * r, block + 2, 2);  /* m */
            }
        }
}

/* G groups of 16 output rows (G = 1 or 2; the second group `stride` bytes after the first)
 * against input rows m0 .. m0 + T - 1. Two groups share each broadcast input and each input's
 * scales: more multiply-adds per instruction for passes of several rows. */
static inline __attribute__((always_inline)) void group_tile(int kind, const uint8_t *group, size_t stride,
                                                              const Quantised *in, float *y, int n_out, int n_in,
                                                              int m0, const int T, const int G) {
    int nb = n_in / QK;
    __m512 acc[2][TILE];
    for (int g = 0; g < G; g++)
        for (int t = 0; t < T; t++) acc[g][t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i w[2][8];
        __m512 dw[2], mw[2];
        for (int g = 0; g < G; g++) {
            if (kind == 0) {
                const uint8_t *block = group + g * stride + (size_t)b * Q4_1_PACKED;
                const __m512i low = _mm512_set1_epi8(0x0f);
                for (int j = 0; j < 4; j++) {
                    __m512i packed = _mm512_loadu_si512((const void *)(block + 64 * j));
                    w[g][j] = _mm512_and_si512(packed, low);
                    w[g][j + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
                }
                dw[g] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 256)));
                mw[g] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 256 + 2 * GROUP)));
            } else {
                const uint8_t *block = group + g * stride + (size_t)b * Q8_0_PACKED;
                for (int j = 0; j < 8; j++) w[g][j] = _mm512_loadu_si512((const void *)(block + 64 * j));
                dw[g] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 512)));
            }
        }
        for (int t = 0; t < T; t++) {
            size_t at = (size_t)(m0 + t) * nb + b;
            const int8_t *xq = in->q + (size_t)(m0 + t) * n_in + (size_t)b * QK;
            __m512i start = kind == 0 ? _mm512_setzero_si512() : _mm512_set1_epi32(in->cx[at]);
            __m512i isum[2] = {start, start};
            for (int j = 0; j < 8; j++) {
                int32_t four;
                memcpy(&four, xq + 4 * j, 4);
                __m512i x = _mm512_set1_epi32(four);
                for (int g = 0; g < G; g++) isum[g] = _mm512_dpbusd_epi32(isum[g], w[g][j], x);
            }
            __m512 dx = _mm512_set1_ps(in->dx[at]), ex = _mm512_set1_ps(in->ex[at]);
            for (int g = 0; g < G; g++) {
                acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[g]), _mm512_mul_ps(dw[g], dx), acc[g][t]);
                if (kind == 0) acc[g][t] = _mm512_fmadd_ps(mw[g], ex, acc[g][t]);
            }
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
DEFINE_GROUP(q4_1_group, 0)
DEFINE_GROUP(q8_0_group, 1)

typedef void (*group_fn)(const uint8_t *, size_t, int, const Quantised *, float *, int, int, int);

/* y [M, n_out] = W x for packed weights (n_out a multiple of 16, n_in of 32), any M >= 1. A pass
 * of up to TILE input rows takes groups one by one (one tile: each weight is unpacked once);
 * longer passes take them in pairs. */
static void run(group_fn group, int packed_size, const uint8_t *packed, const float *x, float *y, int M, int n_out,
                int n_in, int threads) {
    Quantised in;
    if (!quantised_alloc(&in, M, n_in)) {
        for (size_t i = 0; i < (size_t)M * n_out; i++) y[i] = NAN;  /* no memory: never a silent result */
        quantised_free(&in);
        return;
    }
    quantize_vector(x, M, n_in, &in);
    int groups = n_out / GROUP, nb = n_in / QK, span = M > TILE ? 2 : 1, units = (groups + span - 1) / span;
    size_t stride = (size_t)nb * packed_size;
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")
    for (int u = 0; u < units; u++) {
        int g = u * span;
        group(packed + g * stride, stride, g + 1 < groups && span == 2, &in, y + (size_t)g * GROUP, M, n_out, n_in);
    }
    quantised_free(&in);
}

void decodekit_q8_q4_1(const uint8_t *packed, const float *x, float *y, int M, int n_out, int n_in, int threads) {
    run(q4_1_group, Q4_1_PACKED, packed, x, y, M, n_out, n_in, threads);
}

void decodekit_q8_q8_0(const uint8_t *packed, const float *x, float *y, int M, int n_out, int n_in, int threads) {
    run(q8_0_group, Q8_0_PACKED, packed, x, y, M, n_out, n_in, threads);
}

/* The scalar reference, on the GGUF blocks as the file has them: the same arithmetic in the same
 * order, one value at a time. Not vectorised: GCC 12 turns its signed-byte dot product into
 * vpdpbusd, which reads the first operand's bytes as unsigned (a wrong result for Q8_0), and a
 * reference should not depend on the instructions it checks anyway. */
__attribute__((optimize("no-tree-vectorize"))) void decodekit_q8_reference(int kind, const uint8_t *w, const float *x, float *y, int M, int n_out, int n_in) {
    int nb = n_in / QK, bytes = kind == 0 ? Q4_1_BYTES : Q8_0_BYTES;
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
                const uint8_t *block = w + ((size_t)r * nb + b) * bytes;
                const int8_t *xq = in.q + (size_t)m * n_in + (size_t)b * QK;
                size_t at = (size_t)m * nb + b;
                int32_t isum = 0;
                for (int k = 0; k < QK; k++)
                    isum += (kind == 0 ? q4_1_weight(block, k) : (int8_t)block[2 + k]) * xq[k];
                acc = fmaf((float)isum, half_to_float(block) * in.dx[at], acc);
                if (kind == 0) acc = fmaf(half_to_float(block + 2), in.ex[at], acc);
            }
            y[(size_t)m * n_out + r] = acc;
        }
    quantised_free(&in);
}

/* The integer multiply-add peak (`decodekit profile`): `iterations` rounds of 12 independent
 * vpdpbusd per thread, 64 byte products each. Returns a sum of every result, so that none of
 * them can be left out. */
int64_t decodekit_q8_peak(int64_t iterations, int threads) {
    int64_t total = 0;
    _Pragma("omp parallel num_threads(threads) reduction(+ : total)")
    {
        const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
        __m512i acc[12];
        for (int j = 0; j < 12; j++) acc[j] = _mm512_setzero_si512();
        for (int64_t i = 0; i < iterations; i++)
            for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
        for (int j = 0; j < 12; j++) total += _mm512_reduce_add_epi32(acc[j]);
    }
    return total;
}

/* Whether this CPU has the instructions the kernels above use. */
int decodekit_has_avx512vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
}
