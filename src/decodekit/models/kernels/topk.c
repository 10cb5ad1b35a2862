/* Top-k indices of each row of a float32 matrix, for k up to TOPK_MAX.
 *
 * A decode step over SmolLM2's 49152-token vocabulary needs the 8 best logits (token
 * recycling refreshes its successor table every step); torch.topk spends most of its time on
 * setup and a partial sort. Here one pass keeps the k best so far in a small sorted list and
 * compares 16 logits at a time against the k-th best: only the few that beat it are inserted.
 *
 * Order: by value, highest first; equal values by lower index (a later equal value does not
 * displace an earlier one). NaN and -inf never enter; when a row has fewer than k such values
 * the rest of its output is -1. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "decodekit.h"
#include "simd.h"

#define TOPK_MAX 64

static inline void insert(float *best, int32_t *index, int *count, int k, float value, int32_t at) {
    int i = *count < k ? (*count)++ : k - 1;  /* full: the last (worst) entry is dropped */
    while (i > 0 && best[i - 1] < value) {    /* strict: equal values keep their earlier index first */
        best[i] = best[i - 1];
        index[i] = index[i - 1];
        i--;
    }
    best[i] = value;
    index[i] = at;
}

void decodekit_topk_f32(const float *x, int32_t *out, int rows, int n, int k) {
    for (int r = 0; r < rows; r++) {
        const float *row = x + (int64_t)r * n;
        float best[TOPK_MAX];
        int32_t index[TOPK_MAX];
        int count = 0;
        float bar = -INFINITY;  /* a value must be greater than this to enter */
        int j = 0;
        for (; j + 16 <= n; j += 16) {
            __mmask16 hits = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), _mm512_set1_ps(bar), _CMP_GT_OQ);
            while (hits) {
                int lane = __builtin_ctz(hits);
                hits &= hits - 1;
                float value = row[j + lane];
                if (value > bar) {  /* the bar may have risen within these 16 */
                    insert(best, index, &count, k, value, j + lane);
                    if (count == k) bar = best[k - 1];
                }
            }
        }
        for (; j < n; j++) {
            if (row[j] > bar) {
                insert(best, index, &count, k, row[j], j);
                if (count == k) bar = best[k - 1];
            }
        }
        for (int i = 0; i < k; i++) out[(int64_t)r * k + i] = i < count ? index[i] : -1;
    }
}

/* The index of the largest value of x[0..n), the first one among equals (torch.argmax's choice),
 * or -1 where x holds a NaN (torch.argmax then answers the NaN's index; the caller defers to it).
 * One pass, 16 lanes each keeping its largest value and where it was: a later value must be
 * strictly greater to replace it, so each lane keeps its first maximum; lanes then break ties by
 * the lower index. torch.argmax spends most of a vocabulary-sized row on tracking indices. */
int64_t decodekit_argmax_f32(const float *x, int64_t n) {
    int64_t best_at = 0;
    float best = n > 0 ? x[0] : -INFINITY;
    int64_t j = 0;
    if (n >= 16) {
        __m512 lane_best = _mm512_loadu_ps(x);
        __m512i lane_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i at = lane_at;
        const __m512i sixteen = _mm512_set1_epi32(16);
        __mmask16 nan = _mm512_cmp_ps_mask(lane_best, lane_best, _CMP_UNORD_Q);
        /* (int32 lanes: the caller passes rows of fewer than 2^31 entries) */
        for (j = 16; j + 16 <= n; j += 16) {
            __m512 v = _mm512_loadu_ps(x + j);
            at = _mm512_add_epi32(at, sixteen);
            __mmask16 greater = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            lane_best = _mm512_mask_mov_ps(lane_best, greater, v);
            lane_at = _mm512_mask_mov_epi32(lane_at, greater, at);
        }
        if (nan) return -1;
        largest_lane(lane_best, lane_at, &best, &best_at);
    }
    for (; j < n; j++) {
        if (x[j] != x[j]) return -1;
        if (x[j] > best) {
            best = x[j];
            best_at = j;
        }
    }
    return best_at;
}
