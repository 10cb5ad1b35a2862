/* The `fast` numerics: GGUF Q4_1 / Q8_0 weight blocks times inputs quantised to 8 bits, with
 * integer dot products (AVX512-VNNI's vpdpbusd: 32 products of an unsigned and a signed byte,
 * summed four by four into 8 int32 lanes, per instruction).
 *
 * Each input row is quantised per block of 32 values as llama.cpp's Q8_1 does: d = max|x| / 127,
 * q = nearest integer to x / d (computed as x * (1 / d)), and the block's sum of q. A weight block
 * (Q4_1: w = dw * q + mw, q in 0..15; Q8_0: w = dw * q, q in -127..127) against an input block:
 *     sum_j w_j x_j  ~  dw * dx * sum_j q_j qx_j  (+ mw * dx * sum_j qx_j for Q4_1)
 * with the integer sums exact. The float arithmetic is in one fixed order, written out in the
 * scalar reference below, which a test compares with the vector kernel bit for bit:
 *   lane l (0..7) of a block's integer sum covers weights 4l..4l+3;
 *   acc[l] = fma((float) isum[l], dw * dx, acc[l])    block after block;
 *   rest   = fma(mw * dx, (float) sum(qx), rest)      block after block (Q4_1 only);
 *   y      = ((acc[0] + acc[1]) + ... + acc[7]) + rest.
 * Every output row and every input row is computed alone, in that order, whatever else is in
 * the pass, so a token's logits are the same in a plain step, a verification tree or a batch.
 * Output rows are split between threads; a row is never split.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define MAX_ROWS 64

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Quantised inputs: q [M][n_in] int8, d [M][n_in / 32], s [M][n_in / 32] (sum of a block's q). */
static void quantize_rows(const float *x, int M, int n_in, int8_t *q, float *d, int32_t *s) {
    int nb = n_in / QK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)m * n_in + (size_t)b * QK;
            int8_t *qb = q + (size_t)m * n_in + (size_t)b * QK;
            float amax = 0.0f;
            int finite = 1;
            for (int j = 0; j < QK; j++) {
                amax = fmaxf(amax, fabsf(xb[j]));
                finite &= isfinite(xb[j]) != 0;
            }
            float db = amax / 127.0f, inv = db > 0.0f ? 1.0f / db : 0.0f;
            int32_t sum = 0;
            for (int j = 0; j < QK; j++) {
                /* clamped: x * inv can round past 127 by an ulp, and must never be converted out of range */
                int v = finite ? (int)nearbyintf(fminf(127.0f, fmaxf(-127.0f, xb[j] * inv))) : 0;
                qb[j] = (int8_t)v;
                sum += v;
            }
            if (!finite) db = NAN;  /* a NaN or infinite input makes the result NaN, never silently finite */
            d[(size_t)m * nb + b] = db;
            s[(size_t)m * nb + b] = sum;
        }
}

/* Block layouts: Q4_1 {fp16 d, fp16 m, 16 bytes: weight j in the low nibble of byte j, weight
 * j + 16 in the high one} (20 bytes); Q8_0 {fp16 d, int8 q[32]} (34 bytes). */
#define Q4_1_BYTES 20
#define Q8_0_BYTES 34

/* The 32 weights of a Q4_1 block as unsigned bytes in weight order. */
static inline __m256i q4_1_weights(const uint8_t *block) {
    __m128i packed = _mm_loadu_si128((const __m128i *)(block + 4));
    __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0f));
    __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f));
    return _mm256_set_m128i(high, low);
}

static inline float sum_lanes(__m256 acc) {
    float lane[8];
    _mm256_storeu_ps(lane, acc);
    float total = lane[0];
    for (int l = 1; l < 8; l++) total += lane[l];
    return total;
}

/* Output row r against M quantised input rows. */
static void q4_1_row(const uint8_t *w, const int8_t *q, const float *d, const int32_t *s, float *y, int M,
                     int n_out, int n_in, int r) {
    int nb = n_in / QK;
    const uint8_t *row = w + (size_t)r * nb * Q4_1_BYTES;
    __m256 acc[MAX_ROWS];
    float rest[MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps(), rest[m] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *block = row + (size_t)b * Q4_1_BYTES;
        float dw = half_to_float(block), mw = half_to_float(block + 2);
        __m256i wq = q4_1_weights(block);
        for (int m = 0; m < M; m++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(q + (size_t)m * n_in + (size_t)b * QK));
            __m256i isum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq);
            float dx = d[(size_t)m * nb + b];
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dw * dx), acc[m]);
            rest[m] = fmaf(mw * dx, (float)s[(size_t)m * nb + b], rest[m]);
        }
    }
    for (int m = 0; m < M; m++) y[(size_t)m * n_out + r] = sum_lanes(acc[m]) + rest[m];
}

static void q8_0_row(const uint8_t *w, const int8_t *q, const float *d, const int32_t *s, float *y, int M,
                     int n_out, int n_in, int r) {
    (void)s;
    int nb = n_in / QK;
    const uint8_t *row = w + (size_t)r * nb * Q8_0_BYTES;
    __m256 acc[MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *block = row + (size_t)b * Q8_0_BYTES;
        float dw = half_to_float(block);
        __m256i wq = _mm256_loadu_si256((const __m256i *)(block + 2));
        __m256i magnitude = _mm256_abs_epi8(wq);  /* unsigned |w| (128 for -128 read as a byte) */
        for (int m = 0; m < M; m++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(q + (size_t)m * n_in + (size_t)b * QK));
            /* |w| * (x * sign(w)) = w * x, with the unsigned operand first as vpdpbusd wants */
            __m256i isum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, _mm256_sign_epi8(xq, wq));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dw * d[(size_t)m * nb + b]), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) y[(size_t)m * n_out + r] = sum_lanes(acc[m]);
}

typedef void (*row_fn)(const uint8_t *, const int8_t *, const float *, const int32_t *, float *, int, int, int, int);

/* y [M, n_out] = W x for M <= 64 input rows (n_in a multiple of 32). */
static void run(row_fn row, const uint8_t *w, const float *x, float *y, int M, int n_out, int n_in, int threads) {
    int nb = n_in / QK;
    int8_t *q = malloc((size_t)M * n_in);
    float *d = malloc((size_t)M * nb * sizeof(float));
    int32_t *s = malloc((size_t)M * nb * sizeof(int32_t));
    if (q && d && s) {
        quantize_rows(x, M, n_in, q, d, s);
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")
        for (int r = 0; r < n_out; r++) row(w, q, d, s, y, M, n_out, n_in, r);
    } else {
        for (size_t i = 0; i < (size_t)M * n_out; i++) y[i] = NAN;  /* no memory: never a silent result */
    }
    free(q), free(d), free(s);
}

void decodekit_q8_q4_1(const uint8_t *w, const float *x, float *y, int M, int n_out, int n_in, int threads) {
    run(q4_1_row, w, x, y, M, n_out, n_in, threads);
}

void decodekit_q8_q8_0(const uint8_t *w, const float *x, float *y, int M, int n_out, int n_in, int threads) {
    run(q8_0_row, w, x, y, M, n_out, n_in, threads);
}

/* The scalar reference: the same arithmetic in the same order, one value at a time. */
void decodekit_q8_reference(int kind, const uint8_t *w, const float *x, float *y, int M, int n_out, int n_in) {
    int nb = n_in / QK, bytes = kind == 0 ? Q4_1_BYTES : Q8_0_BYTES;
    int8_t *q = malloc((size_t)M * n_in);
    float *d = malloc((size_t)M * nb * sizeof(float));
    int32_t *s = malloc((size_t)M * nb * sizeof(int32_t));
    if (!q || !d || !s) {
        for (size_t i = 0; i < (size_t)M * n_out; i++) y[i] = NAN;
        free(q), free(d), free(s);
        return;
    }
    quantize_rows(x, M, n_in, q, d, s);
    for (int m = 0; m < M; m++)
        for (int r = 0; r < n_out; r++) {
            float acc[8] = {0}, rest = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *block = w + ((size_t)r * nb + b) * bytes;
                const int8_t *xq = q + (size_t)m * n_in + (size_t)b * QK;
                float dw = half_to_float(block), dx = d[(size_t)m * nb + b];
                float scale = dw * dx;
                for (int l = 0; l < 8; l++) {
                    int32_t isum = 0;
                    for (int k = 4 * l; k < 4 * l + 4; k++) {
                        int wq = kind == 0 ? (k < 16 ? block[4 + k] & 0x0f : block[4 + k - 16] >> 4)
                                           : (int8_t)block[2 + k];
                        isum += wq * xq[k];
                    }
                    acc[l] = fmaf((float)isum, scale, acc[l]);
                }
                if (kind == 0) rest = fmaf(half_to_float(block + 2) * dx, (float)s[(size_t)m * nb + b], rest);
            }
            float total = acc[0];
            for (int l = 1; l < 8; l++) total += acc[l];
            y[(size_t)m * n_out + r] = total + rest;
        }
    free(q), free(d), free(s);
}

/* Whether this CPU has the instructions the kernels above use. */
int decodekit_has_avx512vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
}
