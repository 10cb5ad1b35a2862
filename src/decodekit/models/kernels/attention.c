/* Attention for decode steps and small verification passes, computed so that a query's result
 * depends only on the keys it sees, in order: not on how many other queries share the pass,
 * nor on where masked keys sit in the cache.
 *
 * For each (head, query): scores s_j = scale * q.k_j over the visible keys j in cache order
 * (each a fixed-order 16-lane dot product), their max, p_j = exp(s_j - max) (a vectorised
 * exponential), the sum of p_j with the t-th visible key in lane t % 16, and out = (sum_j p_j v_j)
 * / sum with v accumulated one key at a time across the head dimension. A token verified in a tree (prefix + its ancestors visible) thus
 * gets bit for bit the attention output it gets in plain one-token decoding, where the same keys
 * are the contiguous cache prefix. Library attention kernels block the key axis by position,
 * so their rounding depends on the layout; with bfloat16 that flips near-tied tokens.
 *
 * q: [n_q, H, D] float32. k, v: cache of one layer and batch row, [H_kv, cap, D] in float32 or
 * bfloat16. visible: [n_q, n_keys] bytes, or NULL for "all n_keys". out: [n_q, H, D] float32.
 * Needs D % 16 == 0 and D <= 256.
 *
 * Loop order, which changes no result: a job is one row and the heads of a group that share a
 * key/value head (as many as registers hold), so each key and value row is loaded once for them
 * all and their sums run as independent chains; scores are summed sixteen at a time
 * (sum_lanes16, the same pairing as one _mm512_reduce_add_ps each).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decodekit.h"
#include "simd.h"

/* Replace scores[t] by exp(scores[t] - best) and return their sum. The t-th visible key always
 * lands in lane t % 16, so the sum depends only on the sequence of visible scores. */
static float softmax_numerators(float *scores, int n, float best) {
    __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(best);
    for (int t = 0; t < n; t += 16) {
        __mmask16 m = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u);
        __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), shift));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(scores + t, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* The largest score, as "if (s > best) best = s" over them in order finds it (NaN never wins). */
static float largest(const float *scores, int n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        __mmask16 m = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u);
        __m512 s = _mm512_maskz_loadu_ps(m, scores + t);
        best = _mm512_mask_mov_ps(best, _mm512_mask_cmp_ps_mask(m, s, best, _CMP_GT_OQ), s);
    }
    float lanes[16], out = -INFINITY;
    _mm512_storeu_ps(lanes, best);
    for (int l = 0; l < 16; l++)
        if (lanes[l] > out) out = lanes[l];
    return out;
}

/* Where the row's next run of visible keys starts at or after j, and where it ends: the first key
 * at or after j that the row sees (resp. does not see), n when none. 64 mask bytes at a time, so
 * a row that sees a few keys of a long cache (kvdraft's windowed drafts) does not test every
 * byte, and a row that sees a long prefix (verification, prefill, batches) tests none of it one
 * by one. NULL: every key is visible. */
static inline int next_run(const uint8_t *vis, int j, int n, int seen) {
    if (!vis) return seen ? j : n;
    while (j < n) {
        if (n - j >= 64) {
            __m512i bytes = _mm512_loadu_si512((const void *)(vis + j));
            uint64_t found = _mm512_test_epi8_mask(bytes, bytes);
            if (!seen) found = ~found;
            if (found) return j + __builtin_ctzll(found);
            j += 64;
        } else if (!vis[j] == !seen) {
            return j;
        } else {
            j++;
        }
    }
    return n;
}

/* Every key j < n the row sees, in cache order: the loop body runs once per visible key, with
 * no test between the keys of a run (run_ and end_ bound each run). */
#define FOR_EACH_VISIBLE(j, vis, n)                                                                 \
    for (int run_ = next_run(vis, 0, n, 1), end_ = next_run(vis, run_, n, 0); run_ < (n);            \
         run_ = next_run(vis, end_, n, 1), end_ = next_run(vis, run_, n, 0))                         \
        for (int j = run_; j < end_; j++)

/* The lane sums of 16 vectors at once: lane l of the result is the sum of the vector in slot
 * SLOT(l), added in _mm512_reduce_add_ps's pairing (lanes 8 apart, then 4, 2, 1), so a score
 * has the same bits as one reduction of its own vector, for 15 additions a 16 scores, not 60. */
#define SLOT(t) (4 * ((t) % 4) + (t) / 4)
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 c[8], e[4], g[2];
    for (int i = 0; i < 8; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)
        g[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scratch of one thread: per query of a job, its scores (and total past the end) and its q.k
 * products waiting to be summed 16 at a time; the job's visible keys. */
typedef struct {
    float *scores; /* [MAX_Q][n_keys + 1] */
    int *keys;     /* [n_keys] */
    __m512 *waiting; /* [MAX_Q][16] */
    size_t stride;
} Scratch;

#define MAX_Q 4
#ifndef AHEAD
#define AHEAD 8 /* keys ahead of the one read that a job asks the memory for (ask_for) */
#endif

static void scratch_init(Scratch *s, size_t keys) {
    s->stride = keys + 1;
    s->scores = malloc(sizeof(float) * s->stride * MAX_Q);
    s->keys = malloc(sizeof(int) * s->stride);
    s->waiting = aligned_alloc(64, sizeof(__m512) * 16 * MAX_Q);
    for (int i = 0; i < 16 * MAX_Q; i++) s->waiting[i] = _mm512_setzero_ps();
}

static void scratch_free(Scratch *s) { free(s->scores), free(s->keys), free(s->waiting); }

/* How a pass is cut into jobs: (key/value head, row, a share of the group's heads), in that
 * order. A job takes a group's heads together, as many as registers hold (MAX_Q where head_dim
 * is 64, 2 where 128, else 1), fewer only where there would be under `min_jobs` jobs. */
typedef struct {
    int n_q, n_heads, group, per_job, shares, head_dim, jobs;
} JobPlan;

static JobPlan plan_jobs(int n_q, int n_heads, int n_kv_heads, int head_dim, int min_jobs) {
    int group = n_heads / n_kv_heads, chunks = head_dim / 16;
    int most = chunks == 4 ? MAX_Q : chunks == 8 ? 2 : 1;
    int per_job = group < most ? group : most;
    while (per_job > 1 && n_kv_heads * n_q * ((group + per_job - 1) / per_job) < min_jobs) per_job--;
    int shares = (group + per_job - 1) / per_job;
    return (JobPlan){n_q, n_heads, group, per_job, shares, head_dim, n_kv_heads * n_q * shares};
}

/* Job `job`'s key/value head and row, its queries' and outputs' rows (qs[m], outs[m]); returns
 * how many (1..MAX_Q). */
static inline int job_queries(const JobPlan *p, int job, const float *q, float *out, const float **qs, float **outs,
                              int *kv, int *row) {
    int share = job % p->shares, count = p->group - share * p->per_job;
    *kv = job / (p->n_q * p->shares), *row = job / p->shares % p->n_q;
    int first = *kv * p->group + share * p->per_job;
    if (count > p->per_job) count = p->per_job;
    for (int m = 0; m < count; m++) {
        qs[m] = q + ((size_t)*row * p->n_heads + first + m) * p->head_dim;
        outs[m] = out + ((size_t)*row * p->n_heads + first + m) * p->head_dim;
    }
    return count;
}

/* Which compiled job takes `count` queries of head size 16 * `chunks` (0: none; the caller then runs
 * one query at a time), and the case labels calling it, for `switch (job_kind(chunks, count))`.
 * Every kernel compiles the same kinds: 1 to 4 queries at head size 64, 1 or 2 at 128. */
static inline int job_kind(int chunks, int count) { return chunks == 4 ? count : chunks == 8 ? 10 + count : 0; }
#define JOB_CASES(PREFIX, ...)                                                                      \
    case 1: PREFIX##_q1_c4(__VA_ARGS__); break;                                                     \
    case 2: PREFIX##_q2_c4(__VA_ARGS__); break;                                                     \
    case 3: PREFIX##_q3_c4(__VA_ARGS__); break;                                                     \
    case 4: PREFIX##_q4_c4(__VA_ARGS__); break;                                                     \
    case 11: PREFIX##_q1_c8(__VA_ARGS__); break;                                                    \
    case 12: PREFIX##_q2_c8(__VA_ARGS__); break;

/* In a job over Q queries with registers qv[m][c] and a key in kv[c]: each query's products with
 * the key wait in its slot SLOT(waiting) until 16 keys are in, then become 16 scores at once. */
#define SCORE_KEY(Q, CH, position)                                                                  \
    do {                                                                                            \
        for (int m = 0; m < Q; m++) {                                                               \
            __m512 acc = _mm512_mul_ps(qv[m][0], kv[0]);                                            \
            for (int c = 1; c < (CH); c++) acc = _mm512_fmadd_ps(qv[m][c], kv[c], acc);             \
            s->waiting[16 * m + SLOT(waiting)] = acc;                                               \
        }                                                                                           \
        s->keys[n + waiting] = (position);                                                          \
        if (++waiting == 16) {                                                                      \
            store_scores(s, Q, n, 16, scale);                                                       \
            n += 16, waiting = 0;                                                                   \
        }                                                                                           \
    } while (0)

/* The scaled scores of the `count` (1..16) keys waiting for each of `queries` queries, stored from
 * score n on. */
static inline void store_scores(Scratch *s, int queries, int n, int count, float scale) {
    __mmask16 mask = count == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
    for (int m = 0; m < queries; m++)
        _mm512_mask_storeu_ps(s->scores + m * s->stride + n, mask,
                              _mm512_mul_ps(sum_lanes16(s->waiting + 16 * m), _mm512_set1_ps(scale)));
}

/* Each query's n scores replaced by their softmax numerators; inverse[m]: 1 / their sum (0 for none). */
static inline void softmax_numerators_of(Scratch *s, int queries, int n, float *inverse) {
    for (int m = 0; m < queries; m++) {
        float *scores = s->scores + m * s->stride;
        float total = softmax_numerators(scores, n, largest(scores, n));
        inverse[m] = n ? 1.0f / total : 0.0f;
    }
}

/* In a job over Q queries with accumulators o[m][c] and a value row in vv[c]: each query adds the
 * row times its weight (WEIGHT, an expression of m); then out[m] = o[m] / its softmax sum. */
#define ADD_VALUE_ROW(Q, CH, WEIGHT)                                                                \
    for (int m = 0; m < Q; m++) {                                                                   \
        __m512 p = _mm512_set1_ps(WEIGHT);                                                          \
        for (int c = 0; c < (CH); c++) o[m][c] = _mm512_fmadd_ps(p, vv[c], o[m][c]);                \
    }
#define STORE_OUTPUTS(Q, CH)                                                                        \
    for (int m = 0; m < Q; m++)                                                                     \
        for (int c = 0; c < (CH); c++)                                                              \
            _mm512_storeu_ps(out[m] + 16 * c, _mm512_mul_ps(o[m][c], _mm512_set1_ps(inverse[m])));

/* One job: Q queries (rows q[m], outputs out[m]) that read the same key/value head and see the
 * same keys (the heads of one group, for one row). Each key and value row is loaded once for all
 * Q; each query's arithmetic is exactly what it would be alone, and its Q x CH accumulators are
 * independent chains. CH = head_dim / 16 (a constant, so everything stays in registers). */
#define DEFINE_JOB(NAME, T, LOAD, Q, CH)                                                            \
    static void NAME(const float *const *q, const T *kh, const T *vh, const uint8_t *vis, float *const *out, \
                     int n_keys, float scale, Scratch *s) {                                         \
        __m512 qv[Q][CH];                                                                           \
        for (int m = 0; m < Q; m++)                                                                 \
            for (int c = 0; c < CH; c++) qv[m][c] = _mm512_loadu_ps(q[m] + 16 * c);                 \
        int n = 0, waiting = 0;                                                                     \
        FOR_EACH_VISIBLE(j, vis, n_keys) {                                                          \
            const T *kj = kh + (size_t)j * CH * 16;                                                 \
            if (j + AHEAD < n_keys) ask_for(kj + AHEAD * CH * 16, CH * 16 * sizeof(T));             \
            __m512 kv[CH];                                                                          \
            for (int c = 0; c < CH; c++) kv[c] = LOAD(kj + 16 * c);                                 \
            SCORE_KEY(Q, CH, j);                                                                    \
        }                                                                                           \
        if (waiting) store_scores(s, Q, n, waiting, scale), n += waiting;                           \
        float inverse[Q];                                                                           \
        softmax_numerators_of(s, Q, n, inverse);                                                    \
        __m512 o[Q][CH];                                                                            \
        for (int m = 0; m < Q; m++)                                                                 \
            for (int c = 0; c < CH; c++) o[m][c] = _mm512_setzero_ps();                             \
        for (int t = 0; t < n; t++) {                                                               \
            const T *vj = vh + (size_t)s->keys[t] * CH * 16;                                        \
            if (t + AHEAD < n) ask_for(vh + (size_t)s->keys[t + AHEAD] * CH * 16, CH * 16 * sizeof(T)); \
            __m512 vv[CH];                                                                          \
            for (int c = 0; c < CH; c++) vv[c] = LOAD(vj + 16 * c);                                 \
            ADD_VALUE_ROW(Q, CH, s->scores[m * s->stride + t])                                      \
        }                                                                                           \
        STORE_OUTPUTS(Q, CH)                                                                        \
    }

/* The general case (any head_dim, one query a job): the same arithmetic, chunks counted at run time. */
#define DEFINE_ONE(NAME, T, LOAD)                                                                   \
    static void NAME(const float *q, const T *kh, const T *vh, const uint8_t *vis, float *out, int n_keys, \
                     int chunks, float scale, Scratch *s) {                                         \
        __m512 qv[16];                                                                              \
        for (int c = 0; c < chunks; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);                       \
        int n = 0, waiting = 0;                                                                     \
        FOR_EACH_VISIBLE(j, vis, n_keys) {                                                          \
            const T *kj = kh + (size_t)j * chunks * 16;                                             \
            __m512 acc = _mm512_mul_ps(qv[0], LOAD(kj));                                            \
            for (int c = 1; c < chunks; c++) acc = _mm512_fmadd_ps(qv[c], LOAD(kj + 16 * c), acc);  \
            s->waiting[SLOT(waiting)] = acc;                                                        \
            s->keys[n + waiting] = j;                                                               \
            if (++waiting == 16) store_scores(s, 1, n, 16, scale), n += 16, waiting = 0;            \
        }                                                                                           \
        if (waiting) store_scores(s, 1, n, waiting, scale), n += waiting;                           \
        float inverse;                                                                              \
        softmax_numerators_of(s, 1, n, &inverse);                                                   \
        __m512 o[16];                                                                               \
        for (int c = 0; c < chunks; c++) o[c] = _mm512_setzero_ps();                                \
        for (int t = 0; t < n; t++) {                                                               \
            __m512 p = _mm512_set1_ps(s->scores[t]);                                                \
            const T *vj = vh + (size_t)s->keys[t] * chunks * 16;                                    \
            for (int c = 0; c < chunks; c++) o[c] = _mm512_fmadd_ps(p, LOAD(vj + 16 * c), o[c]);    \
        }                                                                                           \
        __m512 inv = _mm512_set1_ps(inverse);                                                       \
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(o[c], inv));  \
    }

/* A pass (plan_jobs): a group's heads are split between jobs only where a thread would have no
 * job. Each job reads its group's keys and values, and reading the cache bounds a decode step's
 * attention, so a one-row pass over three groups on two threads runs them 2:1 rather than
 * halving each group (which read every key and value twice). */
#define DEFINE_ATTENTION(NAME, T, LOAD)                                                             \
    DEFINE_JOB(NAME##_q1_c4, T, LOAD, 1, 4)                                                         \
    DEFINE_JOB(NAME##_q2_c4, T, LOAD, 2, 4)                                                         \
    DEFINE_JOB(NAME##_q3_c4, T, LOAD, 3, 4)                                                         \
    DEFINE_JOB(NAME##_q4_c4, T, LOAD, 4, 4)                                                         \
    DEFINE_JOB(NAME##_q1_c8, T, LOAD, 1, 8)                                                         \
    DEFINE_JOB(NAME##_q2_c8, T, LOAD, 2, 8)                                                         \
    DEFINE_ONE(NAME##_one, T, LOAD)                                                                 \
    void NAME(const float *q, const T *k, const T *v, const uint8_t *visible, float *out,            \
              int n_q, int n_heads, int n_kv_heads, int head_dim, int cap, int n_keys,               \
              float scale, int threads) {                                                           \
        int chunks = head_dim / 16;                                                                 \
        JobPlan plan = plan_jobs(n_q, n_heads, n_kv_heads, head_dim, threads);                      \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)")                               \
        {                                                                                           \
            Scratch s;                                                                              \
            scratch_init(&s, (size_t)n_keys);                                                       \
            _Pragma("omp for schedule(static)")                                                     \
            for (int job = 0; job < plan.jobs; job++) {                                             \
                const float *qs[MAX_Q];                                                             \
                float *outs[MAX_Q];                                                                 \
                int kv, i, count = job_queries(&plan, job, q, out, qs, outs, &kv, &i);              \
                const T *kh = k + (size_t)kv * cap * head_dim, *vh = v + (size_t)kv * cap * head_dim; \
                const uint8_t *vis = visible ? visible + (size_t)i * n_keys : NULL;                 \
                switch (job_kind(chunks, count)) {                                                  \
                JOB_CASES(NAME, qs, kh, vh, vis, outs, n_keys, scale, &s)                           \
                default:                                                                            \
                    for (int m = 0; m < count; m++)                                                 \
                        NAME##_one(qs[m], kh, vh, vis, outs[m], n_keys, chunks, scale, &s);         \
                }                                                                                   \
            }                                                                                       \
            scratch_free(&s);                                                                       \
        }                                                                                           \
    }

DEFINE_ATTENTION(decodekit_attention_f32, float, load_f32)
DEFINE_ATTENTION(decodekit_attention_bf16, uint16_t, load_bf16)

/* The int8 cache (kv cache "int8"): each (head, slot) row is head_dim int8 values then their
 * float32 scale (row bytes head_dim + 4), value = scale * q. Written by layer_ops.c's
 * decodekit_rope_store_q8; read here directly, each query's arithmetic in the same fixed order
 * as above (scores: q . k_int summed 16 lanes at once, times the row's scale and the softmax
 * scale; values: sum of (p scale_v) v_int in key order), so a token's result is the same in any
 * pass. */
static inline __m512 load_q8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }

/* The scaled scores of the `count` (1..16) int8 keys waiting for each of `queries` queries
 * (row_scales[w]: the w-th waiting key's row scale), stored from score n on. */
static inline void store_q8_scores(Scratch *s, int queries, int n, int count, const float *row_scales, float scale) {
    __mmask16 mask = count == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
    __m512 rows = _mm512_maskz_loadu_ps(mask, row_scales);
    for (int m = 0; m < queries; m++)
        _mm512_mask_storeu_ps(s->scores + m * s->stride + n, mask,
                              _mm512_mul_ps(_mm512_mul_ps(sum_lanes16(s->waiting + 16 * m), rows), _mm512_set1_ps(scale)));
}

/* One job on the int8 cache: Q queries of one row that share a key/value head (as DEFINE_JOB),
 * each key and value row loaded and widened once for all of them. CH: head_dim / 16, a constant
 * or the run-time `chunks_` (then one query). */
#define DEFINE_Q8_JOB(NAME, Q, CH)                                                                  \
    static void NAME(const float *const *q, const int8_t *kh, const int8_t *vh, const uint8_t *vis, \
                     float *const *out, int n_keys, int chunks_, float scale, Scratch *s) {         \
        (void)chunks_;                                                                              \
        const size_t row = 16 * (size_t)(CH) + 4;                                                   \
        __m512 qv[Q][16], kv[16];                                                                   \
        for (int m = 0; m < Q; m++)                                                                 \
            for (int c = 0; c < (CH); c++) qv[m][c] = _mm512_loadu_ps(q[m] + 16 * c);               \
        int n = 0, waiting = 0;                                                                     \
        float row_scales[16];                                                                       \
        FOR_EACH_VISIBLE(j, vis, n_keys) {                                                          \
            const int8_t *kj = kh + (size_t)j * row;                                                \
            if (j + AHEAD < n_keys) ask_for(kj + AHEAD * row, (size_t)row);                         \
            for (int c = 0; c < (CH); c++) kv[c] = load_q8(kj + 16 * c);                            \
            for (int m = 0; m < Q; m++) {                                                           \
                __m512 acc = _mm512_mul_ps(qv[m][0], kv[0]);                                        \
                for (int c = 1; c < (CH); c++) acc = _mm512_fmadd_ps(qv[m][c], kv[c], acc);         \
                s->waiting[16 * m + SLOT(waiting)] = acc;                                           \
            }                                                                                       \
            memcpy(&row_scales[waiting], kj + 16 * (CH), sizeof(float));                            \
            s->keys[n + waiting] = j;                                                               \
            if (++waiting == 16) store_q8_scores(s, Q, n, 16, row_scales, scale), n += 16, waiting = 0; \
        }                                                                                           \
        if (waiting) store_q8_scores(s, Q, n, waiting, row_scales, scale), n += waiting;            \
        float inverse[Q];                                                                           \
        softmax_numerators_of(s, Q, n, inverse);                                                    \
        __m512 o[Q][16], vv[16];                                                                    \
        for (int m = 0; m < Q; m++)                                                                 \
            for (int c = 0; c < (CH); c++) o[m][c] = _mm512_setzero_ps();                           \
        for (int t = 0; t < n; t++) {                                                               \
            const int8_t *vj = vh + (size_t)s->keys[t] * row;                                       \
            if (t + AHEAD < n) ask_for(vh + (size_t)s->keys[t + AHEAD] * row, (size_t)row);        \
            float vscale;                                                                           \
            memcpy(&vscale, vj + 16 * (CH), sizeof(float));                                         \
            for (int c = 0; c < (CH); c++) vv[c] = load_q8(vj + 16 * c);                            \
            ADD_VALUE_ROW(Q, CH, s->scores[m * s->stride + t] * vscale)                             \
        }                                                                                           \
        STORE_OUTPUTS(Q, CH)                                                                        \
    }

DEFINE_Q8_JOB(q8_q1_c4, 1, 4)
DEFINE_Q8_JOB(q8_q2_c4, 2, 4)
DEFINE_Q8_JOB(q8_q3_c4, 3, 4)
DEFINE_Q8_JOB(q8_q4_c4, 4, 4)
DEFINE_Q8_JOB(q8_q1_c8, 1, 8)
DEFINE_Q8_JOB(q8_q2_c8, 2, 8)
DEFINE_Q8_JOB(q8_one, 1, chunks_)

/* Jobs as the float kernels'. */
void decodekit_attention_q8(const float *q, const int8_t *k, const int8_t *v, const uint8_t *visible, float *out,
                            int n_q, int n_heads, int n_kv_heads, int head_dim, int cap, int n_keys, float scale,
                            int threads) {
    int chunks = head_dim / 16;
    size_t row = (size_t)head_dim + 4;
    JobPlan plan = plan_jobs(n_q, n_heads, n_kv_heads, head_dim, threads);
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        Scratch s;
        scratch_init(&s, (size_t)n_keys);
        _Pragma("omp for schedule(static)")
        for (int job = 0; job < plan.jobs; job++) {
            const float *qs[MAX_Q];
            float *outs[MAX_Q];
            int kv, i, count = job_queries(&plan, job, q, out, qs, outs, &kv, &i);
            const int8_t *kh = k + (size_t)kv * cap * row, *vh = v + (size_t)kv * cap * row;
            const uint8_t *vis = visible ? visible + (size_t)i * n_keys : NULL;
            switch (job_kind(chunks, count)) {
            JOB_CASES(q8, qs, kh, vh, vis, outs, n_keys, chunks, scale, &s)
            default:
                for (int m = 0; m < count; m++) q8_one(qs + m, kh, vh, vis, outs + m, n_keys, chunks, scale, &s);
            }
        }
        scratch_free(&s);
    }
}

/* The KIVI caches (kv caches "int4" and "int2"; Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric
 * 2bit Quantization for KV Cache"). Positions below a row's quantised end `qend[i]` are read from
 * codes of `bits` bits: a key is scale_c * code + min_c per channel c, with scale and min shared by
 * a group of `group` tokens (per channel); a value is scale * code + min with scale and min its
 * token's own. Positions from qend[i] on are read from the float32 residual buffer, whose slot 0
 * holds position `base` (base <= qend[i]); `visible` covers the buffer's first n_residual slots only
 * (the quantised prefix precedes every row and is all visible).
 *
 * Codes: 16 channels in n = 2 * bits bytes, byte b holding channels b, b + n, b + 2n, ... from its
 * lowest bits up (4 bits: channel b in the low nibble, b + 8 in the high one). k_codes, v_codes:
 * [H_kv, cap_q, D * bits / 8]; k_params: [H_kv, cap_q / group, 2, D] (scales, then minima); v_params:
 * [H_kv, cap_q, 2]; k_residual, v_residual: [H_kv, cap_residual, D].
 *
 * A row's keys are visited in position order and each entry is rebuilt in registers with one
 * fused multiply-add before the same fixed-order arithmetic as the float kernels, so a row's
 * result depends only on its position (which fixes qend) and the keys it sees: speculation over
 * this cache is lossless relative to plain decoding with it. */
static inline __m512 codes_to_floats(__m128i codes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)); }

/* 4 bits: the 16 codes of one chunk (8 bytes), or of four chunks (32 bytes) at once. */
static inline __m512 load_q4(const uint8_t *p) {
    __m128i bytes = _mm_loadl_epi64((const __m128i *)p), low = _mm_set1_epi8(0x0F);
    return codes_to_floats(_mm_unpacklo_epi64(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
}

static inline void load_q4_x4(const uint8_t *p, __m512 *out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i bytes = _mm256_loadu_si256((const __m256i *)p);
    __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    __m256i even = _mm256_unpacklo_epi64(lo, hi), odd = _mm256_unpackhi_epi64(lo, hi); /* chunks 0, 2 | 1, 3 */
    out[0] = codes_to_floats(_mm256_castsi256_si128(even));
    out[1] = codes_to_floats(_mm256_castsi256_si128(odd));
    out[2] = codes_to_floats(_mm256_extracti128_si256(even, 1));
    out[3] = codes_to_floats(_mm256_extracti128_si256(odd, 1));
}

/* 2 bits: the bit pairs k = 0..3 of 16 bytes (four chunks of 4), each pair in a byte of its own. */
static inline void q2_pairs(__m128i bytes, __m128i *pair) {
    const __m128i three = _mm_set1_epi8(3);
    for (int k = 0; k < 4; k++) pair[k] = _mm_and_si128(_mm_srli_epi16(bytes, 2 * k), three);
}

static inline __m512 load_q2(const uint8_t *p) {
    int32_t word;
    memcpy(&word, p, 4);
    __m128i pair[4];
    q2_pairs(_mm_cvtsi32_si128(word), pair);
    return codes_to_floats(_mm_unpacklo_epi64(_mm_unpacklo_epi32(pair[0], pair[1]), _mm_unpacklo_epi32(pair[2], pair[3])));
}

static inline void load_q2_x4(const uint8_t *p, __m512 *out) {
    __m128i pair[4];
    q2_pairs(_mm_loadu_si128((const __m128i *)p), pair);
    __m128i a = _mm_unpacklo_epi32(pair[0], pair[1]), b = _mm_unpacklo_epi32(pair[2], pair[3]); /* chunks 0, 1 */
    __m128i c = _mm_unpackhi_epi32(pair[0], pair[1]), d = _mm_unpackhi_epi32(pair[2], pair[3]); /* chunks 2, 3 */
    out[0] = codes_to_floats(_mm_unpacklo_epi64(a, b));
    out[1] = codes_to_floats(_mm_unpackhi_epi64(a, b));
    out[2] = codes_to_floats(_mm_unpacklo_epi64(c, d));
    out[3] = codes_to_floats(_mm_unpackhi_epi64(c, d));
}

/* The codes of `chunks` chunks of 16 channels as floats, four chunks at once where they can be
 * (the same values either way). */
static inline void load_codes(const uint8_t *p, __m512 *out, int chunks, int bits) {
    int c = 0, bytes = 2 * bits; /* a chunk's */
    for (; c + 4 <= chunks; c += 4) {
        if (bits == 4) load_q4_x4(p + bytes * c, out + c);
        else load_q2_x4(p + bytes * c, out + c);
    }
    for (; c < chunks; c++) out[c] = bits == 4 ? load_q4(p + bytes * c) : load_q2(p + bytes * c);
}

/* One key/value head of a KIVI cache, for one layer. */
typedef struct {
    const uint8_t *kc, *vc;  /* codes: [cap_q, D * bits / 8] */
    const float *kp, *vp;    /* parameters: [cap_q / group, 2, D], [cap_q, 2] */
    const float *kb, *vb;    /* residual: [cap_residual, D] */
    int group, base, end, n_residual, bits;
} KiviHead;

/* One job: Q queries (rows q[m], outputs out[m]) of one row that share a key/value head, CH =
 * head_dim / 16 (a constant where registers hold them all, else a variable). Each key and value
 * is rebuilt once for all Q; each query's arithmetic is what it would be alone. */
#define DEFINE_KIVI_JOB(NAME, Q, CH_PARAM, CH)                                                      \
    static void NAME(const float *const *q, float *const *out, const KiviHead *h, const uint8_t *vis, \
                     int CH_PARAM, float scale, Scratch *s) {                                       \
        (void)chunks_;                                                                              \
        const int row_bytes = 2 * h->bits * (CH);                                                   \
        __m512 qv[Q][CH], ks[CH], km[CH], kv[CH];                                                   \
        for (int m = 0; m < Q; m++)                                                                 \
            for (int c = 0; c < (CH); c++) qv[m][c] = _mm512_loadu_ps(q[m] + 16 * c);               \
        int n = 0, waiting = 0;                                                                     \
        for (int c = 0; c < (CH); c++) ks[c] = km[c] = _mm512_setzero_ps();                         \
        for (int j = 0; j < h->end; j++) { /* the codes: positions 0 .. end - 1 */                  \
            if (j % h->group == 0) {                                                                \
                const float *p = h->kp + (size_t)(j / h->group) * 2 * 16 * (CH);                   \
                for (int c = 0; c < (CH); c++)                                                      \
                    ks[c] = _mm512_loadu_ps(p + 16 * c), km[c] = _mm512_loadu_ps(p + 16 * ((CH) + c)); \
            }                                                                                       \
            load_codes(h->kc + (size_t)j * row_bytes, kv, (CH), h->bits);                           \
            for (int c = 0; c < (CH); c++) kv[c] = _mm512_fmadd_ps(kv[c], ks[c], km[c]);            \
            SCORE_KEY(Q, CH, j);                                                                    \
        }                                                                                           \
        FOR_EACH_VISIBLE(slot, vis, h->n_residual) { /* the residual, from the row's quantised end on */ \
            if (h->base + slot < h->end) continue;                                                  \
            const float *kj = h->kb + (size_t)slot * 16 * (CH);                                     \
            for (int c = 0; c < (CH); c++) kv[c] = _mm512_loadu_ps(kj + 16 * c);                    \
            SCORE_KEY(Q, CH, h->base + slot);                                                       \
        }                                                                                           \
        if (waiting) store_scores(s, Q, n, waiting, scale), n += waiting;                           \
        float inverse[Q];                                                                           \
        softmax_numerators_of(s, Q, n, inverse);                                                    \
        __m512 o[Q][CH], vv[CH];                                                                    \
        for (int m = 0; m < Q; m++)                                                                 \
            for (int c = 0; c < (CH); c++) o[m][c] = _mm512_setzero_ps();                           \
        for (int t = 0; t < n; t++) {                                                               \
            int position = s->keys[t];                                                              \
            if (position < h->end) {                                                                \
                const uint8_t *vj = h->vc + (size_t)position * row_bytes;                           \
                __m512 vs = _mm512_set1_ps(h->vp[2 * (size_t)position]);                            \
                __m512 vm = _mm512_set1_ps(h->vp[2 * (size_t)position + 1]);                        \
                load_codes(vj, vv, (CH), h->bits);                                                  \
                for (int c = 0; c < (CH); c++) vv[c] = _mm512_fmadd_ps(vv[c], vs, vm);              \
            } else {                                                                                \
                const float *vj = h->vb + (size_t)(position - h->base) * 16 * (CH);                 \
                for (int c = 0; c < (CH); c++) vv[c] = _mm512_loadu_ps(vj + 16 * c);                \
            }                                                                                       \
            ADD_VALUE_ROW(Q, CH, s->scores[m * s->stride + t])                                      \
        }                                                                                           \
        STORE_OUTPUTS(Q, CH)                                                                        \
    }

DEFINE_KIVI_JOB(kivi_q1_c4, 1, chunks_, 4)
DEFINE_KIVI_JOB(kivi_q2_c4, 2, chunks_, 4)
DEFINE_KIVI_JOB(kivi_q3_c4, 3, chunks_, 4)
DEFINE_KIVI_JOB(kivi_q4_c4, 4, chunks_, 4)
DEFINE_KIVI_JOB(kivi_q1_c8, 1, chunks_, 8)
DEFINE_KIVI_JOB(kivi_q2_c8, 2, chunks_, 8)
DEFINE_KIVI_JOB(kivi_one, 1, chunks_, chunks_)

void decodekit_attention_kivi(const float *q, const uint8_t *k_codes, const float *k_params, const uint8_t *v_codes,
                              const float *v_params, const float *k_residual, const float *v_residual, const int32_t *qend,
                              const uint8_t *visible, float *out, int n_q, int n_heads, int n_kv_heads, int head_dim,
                              int group, int bits, int cap_q, int cap_residual, int base, int n_residual, float scale,
                              int threads) {
    int chunks = head_dim / 16, row_bytes = head_dim * bits / 8;
    /* two jobs for every thread at least: the codes are light to read, so here an uneven split
     * costs more than reading a group's codes twice */
    JobPlan plan = plan_jobs(n_q, n_heads, n_kv_heads, head_dim, 2 * threads);
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        Scratch s;
        scratch_init(&s, (size_t)cap_q + n_residual);
        _Pragma("omp for schedule(static)")
        for (int job = 0; job < plan.jobs; job++) {
            const float *qs[MAX_Q];
            float *outs[MAX_Q];
            int kv, i, count = job_queries(&plan, job, q, out, qs, outs, &kv, &i);
            KiviHead h = {k_codes + (size_t)kv * cap_q * row_bytes, v_codes + (size_t)kv * cap_q * row_bytes,
                          k_params + (size_t)kv * (cap_q / group) * 2 * head_dim, v_params + (size_t)kv * cap_q * 2,
                          k_residual + (size_t)kv * cap_residual * head_dim, v_residual + (size_t)kv * cap_residual * head_dim,
                          group, base, qend[i], n_residual, bits};
            const uint8_t *vis = visible ? visible + (size_t)i * n_residual : NULL;
            switch (job_kind(chunks, count)) {
            JOB_CASES(kivi, qs, outs, &h, vis, chunks, scale, &s)
            default:
                for (int m = 0; m < count; m++) kivi_one(qs + m, outs + m, &h, vis, chunks, scale, &s);
            }
        }
        scratch_free(&s);
    }
}
