/* A grammar's token bitmask applied to one row of logits.
 *
 * Structured decoding masks every decode step: llguidance gives the allowed tokens as a bitmask
 * (bit t % 32 of 32-bit word t / 32 is token t, little-endian, so 16-bit half-word t / 16 holds
 * bit t % 16). Unpacking it into one byte per token and selecting with torch takes tens of
 * microseconds for a 49152-token vocabulary, after a copy of the logits; here each half-word is
 * an AVX-512 blend mask, and 16 logits are copied with their refused tokens set to -inf in one
 * load and one store. `out` may be `in` (in place).
 *
 * Tokens at or past `known` (those the grammar's tokenizer does not have) are refused too. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "decodekit.h"
#include "simd.h"
#include <string.h>

static inline uint16_t half_word(const uint8_t *bits, int64_t i) {
    uint16_t h;
    memcpy(&h, bits + 2 * i, 2);  /* the bytes need no alignment; compiles to one load */
    return h;
}

void decodekit_mask_logits_f32(float *out, const float *in, const uint8_t *bits, int64_t n, int64_t known) {
    const __m512 refused = _mm512_set1_ps(-INFINITY);
    int64_t end = known < n ? known : n;
    int64_t i = 0;
    for (; i + 16 <= end; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mask_blend_ps((__mmask16)half_word(bits, i / 16), refused, _mm512_loadu_ps(in + i)));
    for (; i < end; i++)
        out[i] = (bits[i / 8] >> (i % 8)) & 1 ? in[i] : -INFINITY;
    for (; i < n; i++)
        out[i] = -INFINITY;
}

/* The argmax of the row decodekit_mask_logits_f32 would write, without writing it: the first index
 * of the largest allowed logit (greedy decoding under a grammar needs only that token). Each lane
 * keeps its largest allowed value and where it was, starting from -inf at the lane's first index,
 * so a row with nothing above -inf answers 0, as torch.argmax of the masked row does. -1 where an
 * allowed logit is NaN (torch would answer its index; the caller defers to torch). */
int64_t decodekit_masked_argmax_f32(const float *in, const uint8_t *bits, int64_t n, int64_t known) {
    int64_t end = known < n ? known : n;
    int64_t i = 0, best_at = 0;
    float best = -INFINITY;
    if (end >= 16) {
        __m512 lane_best = _mm512_set1_ps(-INFINITY);
        __m512i lane_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i at = lane_at;
        const __m512i sixteen = _mm512_set1_epi32(16);
        __mmask16 nan = 0;
        for (; i + 16 <= end; i += 16) {
            __mmask16 allowed = (__mmask16)half_word(bits, i / 16);
            __m512 v = _mm512_loadu_ps(in + i);
            __mmask16 greater = _mm512_mask_cmp_ps_mask(allowed, v, lane_best, _CMP_GT_OQ);
            nan |= _mm512_mask_cmp_ps_mask(allowed, v, v, _CMP_UNORD_Q);
            lane_best = _mm512_mask_mov_ps(lane_best, greater, v);
            lane_at = _mm512_mask_mov_epi32(lane_at, greater, at);
            at = _mm512_add_epi32(at, sixteen);
        }
        if (nan) return -1;
        largest_lane(lane_best, lane_at, &best, &best_at);
    }
    for (; i < end; i++) {
        if (!((bits[i / 8] >> (i % 8)) & 1)) continue;
        if (in[i] != in[i]) return -1;
        if (in[i] > best) {
            best = in[i];
            best_at = i;
        }
    }
    return best_at;  /* tokens past `known` are -inf: never above the best so far */
}
