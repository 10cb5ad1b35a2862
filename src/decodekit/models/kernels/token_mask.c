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
