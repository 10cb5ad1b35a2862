/* Attention for decode steps and small verification passes, computed so that a query's result
 * depends only on the keys it sees, in order: not on how many other queries share the pass,
 * nor on where masked keys sit in the cache.
 *
 * For each (head, query): scores s_t = scale * q.k_t over the visible keys in cache order (t
 * counts the visible keys; each score a fixed-order 16-lane dot product), cut into segments of
 * SEGMENT_KEYS visible keys. In segment k: its max m_k, p_t = exp(s_t - m_k) (a vectorised
 * exponential), their sum l_k with key t in lane t % 16, and o_k = sum_t p_t v_t with v added one
 * key at a time across the head dimension. Then, segment after segment, with m the largest m_k
 * and w_k = expf(m_k - m): L = sum_k w_k l_k, O = sum_k w_k o_k (fused multiply-adds from zero),
 * and out = O * (1 / L). (One segment: out = o_0 * (1 / l_0).) The segments are the split of
 * Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023): a pass over few key/value heads (a decode
 * step, a verification) gives each thread a share of every head's segments, from those that every
 * row sees whole, instead of whole heads (plan_jobs, plan_pass), and folds them after (fold_segments). Since
 * segments count visible keys, not cache slots, a token verified in a tree (prefix + its
 * ancestors visible) gets bit for bit the attention output it gets in plain one-token decoding,
 * where the same keys are the contiguous cache prefix, however the pass is split. Library
 * attention kernels block the key axis by position, so their rounding depends on the layout; with
 * bfloat16 that flips near-tied tokens.
 *
 * q: [n_q, H, D] float32. k, v: cache of one layer and batch row, [H_kv, cap, D] in float32 or
 * bfloat16. visible: [n_q, n_keys] bytes, or NULL for "all n_keys". out: [n_q, H, D] float32.
 * Needs D % 16 == 0 and D <= 256.
 *
 * Loop order, which changes no result: a job is the heads of a group that share a key/value head
 * (as many as registers hold), so each key and value row is loaded once for them all and their
 * sums run as independent chains, for one row or, where the cache is long or the rows many, a
 * block of rows that go over each tile of keys in turn (a tile then comes from memory once for
 * them all; on AVX-512 it is transposed once, and each key's score is summed across registers
 * instead of across lanes; on AVX2, whose 16 registers cannot hold those sums, the keys stay rows
 * and eight keys' lanes are summed at once by shuffles: tile_scores_all). A score always has the
 * bits of the 16-lane product summed in _mm512_reduce_add_ps's pairing (sum_lanes16 sums sixteen
 * at a time that way).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decodekit.h"
#include "simd.h"

/* The mask of a vector's first `count` lanes (all 16 from 16 on). */
static inline __mmask16 first_lanes(int count) { return count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u); }

/* Replace scores[t] by exp(scores[t] - best) and return their sum. The t-th visible key always
 * lands in lane t % 16, so the sum depends only on the sequence of visible scores. */
static float softmax_numerators(float *scores, int n, float best) {
    __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(best);
    int t = 0;
    for (; t + 16 <= n; t += 16) { /* whole vectors: no masks (each one several operations on AVX2) */
        __m512 e = vexp(_mm512_sub_ps(_mm512_loadu_ps(scores + t), shift));
        _mm512_storeu_ps(scores + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (t < n) {
        __mmask16 m = first_lanes(n - t);
        __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), shift));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(scores + t, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* The largest score, as "if (s > best) best = s" over them in order finds it (NaN never wins):
 * max_ps(s, best) is exactly that, "s > best ? s : best", lane by lane. */
static float largest(const float *scores, int n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    int t = 0;
    for (; t + 16 <= n; t += 16) best = _mm512_max_ps(_mm512_loadu_ps(scores + t), best);
    if (t < n) {
        __mmask16 m = first_lanes(n - t);
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

/* Every key lo <= j < hi the row sees, in cache order: the loop body runs once per visible key,
 * with no test between the keys of a run (run_ and end_ bound each run). */
#define FOR_EACH_VISIBLE(j, vis, lo, hi)                                                            \
    for (int run_ = next_run(vis, lo, hi, 1), end_ = next_run(vis, run_, hi, 0); run_ < (hi);        \
         run_ = next_run(vis, end_, hi, 1), end_ = next_run(vis, run_, hi, 0))                       \
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

/* A job's row in progress: its queries' scores (and total past the end) and its visible keys in
 * order; the q.k products waiting to be summed 16 at a time (and, over an int8 cache, their keys'
 * row scales); between tiles of keys, how far it has got and its value sums; its segments'
 * results, where a job that holds all of them keeps them (segment_slot). */
typedef struct {
    float *scores;         /* [MAX_Q][stride] */
    int *keys;             /* [stride] */
    __m512 *waiting, *o;   /* [MAX_Q][16] each */
    float *part;           /* [MAX_Q][Scratch.segments][segment_slot] */
    float row_scales[16];
    size_t stride;
    int n, held, t;        /* scores stored, products waiting, keys whose values are added */
} RowState;

#ifndef SEGMENT_KEYS
#define SEGMENT_KEYS 256 /* visible keys a segment (the header): a multiple of 16, so a key's lane is the same in its segment */
#endif
_Static_assert(SEGMENT_KEYS > 0 && SEGMENT_KEYS % 16 == 0, "SEGMENT_KEYS: a multiple of 16 (the lanes of the sums)");

/* A segment's result takes a slot of head_dim + 2 floats: o_k, then m_k and l_k. */
static inline size_t segment_slot(int head_dim) { return (size_t)head_dim + 2; }
static inline int segments_of(int n_keys) { return (n_keys + SEGMENT_KEYS - 1) / SEGMENT_KEYS; }

#define MAX_Q 4
#ifndef ROW_BLOCK
#define ROW_BLOCK 16 /* rows a job takes at most (reading each tile of keys once for them all) */
#endif
#ifndef TILE_KEYS
#define TILE_KEYS 128 /* a tile of keys (and values): read once from memory for a job's rows (a multiple of 16) */
#endif
#ifndef AHEAD
#define AHEAD 8 /* keys ahead of the one read that a job asks the memory for (ask_for) */
#endif
_Static_assert(TILE_KEYS > 0 && TILE_KEYS % 16 == 0, "TILE_KEYS: a multiple of 16 (PREPARE_TILE, kscale)");

/* Scratch of one thread: the rows of its jobs; for jobs of several rows, a tile of keys
 * prepared (PREPARE_TILE: TILE_KEYS keys of `dims` values as float32, and their row scales). */
typedef struct {
    RowState row[ROW_BLOCK];
    void *vectors;
    float *kt, *kscale;
    int rows, segments;
} Scratch;

static void scratch_init(Scratch *s, int rows, size_t keys, int dims) {
    size_t stride = keys + 1;
    s->rows = rows;
    s->segments = segments_of((int)keys) > 0 ? segments_of((int)keys) : 1;
    s->vectors = aligned_alloc(64, sizeof(__m512) * 32 * MAX_Q * (size_t)rows);
    s->kt = rows > 1 ? aligned_alloc(64, sizeof(float) * TILE_KEYS * (size_t)dims) : NULL;
    s->kscale = rows > 1 ? aligned_alloc(64, sizeof(float) * TILE_KEYS) : NULL;
    for (int r = 0; r < rows; r++) {
        RowState *rs = &s->row[r];
        rs->stride = stride;
        rs->scores = malloc(sizeof(float) * stride * MAX_Q);
        rs->keys = malloc(sizeof(int) * stride);
        rs->part = malloc(sizeof(float) * MAX_Q * (size_t)s->segments * segment_slot(dims));
        rs->waiting = (__m512 *)s->vectors + 32 * MAX_Q * r;
        rs->o = rs->waiting + 16 * MAX_Q;
        for (int i = 0; i < 32 * MAX_Q; i++) rs->waiting[i] = _mm512_setzero_ps();
    }
}

static void scratch_free(Scratch *s) {
    for (int r = 0; r < s->rows; r++) free(s->row[r].scores), free(s->row[r].keys), free(s->row[r].part);
    free(s->vectors), free(s->kt), free(s->kscale);
}

/* How a pass is cut into jobs: (key/value head, block of rows, a share of the group's heads, a
 * piece of the keys), in the order job_of says. A job takes up to `max_rows` rows and a group's
 * heads together, as many as registers hold (MAX_Q where head_dim is 64, 2 where 128, else 1).
 * Where the keys can be cut (`units` of them, at least 2: pieces_of), they are cut into pieces,
 * each a job, until the jobs are a multiple of `min_jobs`: a decode step over three key/value
 * heads on two threads runs 3:3 half heads, not 2:1 heads, and a verification of 5 rows over a
 * long cache runs its rows together (each tile of keys read once for them all) in 3:3 half
 * heads, not in blocks of 2 and 3 rows (every key read twice, 2:3 rows). Otherwise rows are
 * split into more blocks where the jobs would not be a multiple of `min_jobs` (or fewer), then
 * heads into shares where there would still be under `min_jobs` jobs. */
typedef struct {
    int n_q, n_heads, n_kv, group, per_job, shares, blocks, head_dim, pieces, units, jobs, max_rows;
} JobPlan;

static JobPlan plan_jobs(int n_q, int n_heads, int n_kv_heads, int head_dim, int min_jobs, int max_rows, int units) {
    if (min_jobs < 1) min_jobs = 1; /* no thread asked for: one (and no division by zero below) */
    int group = n_heads / n_kv_heads, chunks = head_dim / 16;
    int most = chunks == 4 ? MAX_Q : chunks == 8 ? 2 : 1;
    int per_job = group < most ? group : most;
    int blocks = (n_q + max_rows - 1) / max_rows;
    /* attention is bound by its arithmetic more than by reading the cache: as many jobs as threads
     * at least, in a multiple of them where the rows allow (each thread as many) */
    while (units < 2 && blocks < n_q && (n_kv_heads * blocks < min_jobs || n_kv_heads * blocks % min_jobs)) blocks++;
    while (units < 2 && per_job > 1 && n_kv_heads * blocks * ((group + per_job - 1) / per_job) < min_jobs) per_job--;
    int shares = (group + per_job - 1) / per_job, jobs = n_kv_heads * blocks * shares, pieces = 1;
    while (pieces < units && jobs * pieces % min_jobs) pieces++;
    return (JobPlan){n_q, n_heads, n_kv_heads, group, per_job, shares, blocks, head_dim, pieces, units, jobs * pieces, max_rows};
}

/* The first key some row of the pass does not see (n_keys: none), by runs of its mask. */
static int seen_by_every_row(const uint8_t *visible, int n_q, int n_keys) {
    int common = n_keys;
    for (int r = 0; visible && r < n_q && common > 0; r++) {
        int unseen = next_run(visible + (size_t)r * n_keys, 0, common, 0);
        if (unseen < common) common = unseen;
    }
    return common;
}

/* Where a pass's keys can be cut into pieces: at the starts of the segments that every row sees
 * from its first key on (there a key's segment is the same in every row: the row sees every key
 * before it), the last piece taking the rest. Returns the units between those starts (whole
 * segments, then the rest); under 2, no pieces. */
static inline int pieces_of(int common, int n_keys) {
    int units = common / SEGMENT_KEYS + 1;
    return units < segments_of(n_keys) ? units : segments_of(n_keys);
}

/* How many keys a row sees (n_keys where visible is NULL). */
static int visible_count(const uint8_t *visible, int n_keys) {
    int count = 0;
    for (int run = next_run(visible, 0, n_keys, 1); run < n_keys;) {
        int end = next_run(visible, run, n_keys, 0);
        count += end - run;
        run = next_run(visible, end, n_keys, 1);
    }
    return count;
}

/* Whether the jobs of a pass of n_q rows take several rows each (tiles of keys read once for them,
 * scored a block at once: DEFINE_JOB), given the bytes of a head's keys and values: for many rows, or
 * where the head outgrows the cache next to a core, from 4 rows (measured, docs/BENCHMARKS.md: 2
 * rows over a long cache run faster a job a row, each reading it). Otherwise a job a row: more
 * jobs to share between threads, and for a few rows over a short cache, faster. */
static inline int rows_share_jobs(int n_q, size_t head_bytes) {
    return n_q >= 16 || (n_q >= 8 && head_bytes >= ((size_t)1 << 20)) || (n_q >= 4 && head_bytes >= ((size_t)2 << 20));
}

/* One job: `rows` rows of the pass, `count` queries each (heads of one group, so they read the
 * same key/value head): their query and output rows, each row's mask (NULL: all keys), where each
 * query's segment results go (its first segment in the job's slot), and the cache slots lo .. hi
 * - 1 it scores. A whole job (every segment of its rows) folds them; a piece leaves them for
 * the pass to fold. */
typedef struct {
    const float *q[ROW_BLOCK][MAX_Q];
    float *out[ROW_BLOCK][MAX_Q];
    float *part[ROW_BLOCK][MAX_Q];
    const uint8_t *vis[ROW_BLOCK];
    int rows, count, kv, first_row, lo, hi, whole;
} Job;

/* Where job `index` of plan p falls: its key/value head, its first row and row count, its first
 * query head and query count, and its piece's first unit and cache slots lo .. hi - 1. */
typedef struct {
    int kv, first_row, rows, first, count, first_unit, lo, hi;
} JobSpan;

static inline JobSpan span_of(const JobPlan *p, int index, int n_keys) {
    JobSpan j;
    int piece = index % p->pieces;
    index /= p->pieces;
    j.first_unit = p->units * piece / p->pieces;
    int end_unit = p->units * (piece + 1) / p->pieces;
    j.lo = p->pieces == 1 ? 0 : j.first_unit * SEGMENT_KEYS;
    j.hi = p->pieces == 1 || end_unit == p->units ? n_keys : end_unit * SEGMENT_KEYS;
    int share = index % p->shares, block;
    if (p->blocks == p->n_q) /* a row a job: a thread's jobs follow each other in the same key/value head */
        block = index / p->shares % p->blocks, j.kv = index / (p->shares * p->blocks);
    else /* blocks of rows: the threads read the same key/value head at the same time */
        j.kv = index / p->shares % p->n_kv, block = index / (p->shares * p->n_kv);
    int count = p->group - share * p->per_job;
    j.first_row = (int)((int64_t)block * p->n_q / p->blocks);
    j.rows = (int)((int64_t)(block + 1) * p->n_q / p->blocks) - j.first_row;
    j.count = count > p->per_job ? p->per_job : count;
    j.first = j.kv * p->group + share * p->per_job;
    return j;
}

/* The most work one of `threads` threads gets from plan p, in rows x queries x keys, as
 * schedule(static) deals the jobs (in contiguous runs, the first jobs % threads one longer). */
static int64_t heaviest_thread(const JobPlan *p, int n_keys, int threads) {
    int64_t most = 0;
    for (int t = 0, index = 0; t < threads; t++) {
        int64_t load = 0;
        for (int end = index + p->jobs / threads + (t < p->jobs % threads); index < end; index++) {
            JobSpan j = span_of(p, index, n_keys);
            load += (int64_t)j.rows * j.count * (j.hi - j.lo);
        }
        most = load > most ? load : most;
    }
    return most;
}

/* The plan of a pass of n_q rows over n_keys keys (`visible` as the kernels take it) whose heads'
 * keys and values take `head_bytes` each: pieces where the keys can be cut, unless cutting the rows
 * and heads instead leaves the busiest thread less to do. Pieces end at segment starts, so over a
 * short cache they can be lopsided: 16 rows over 272 keys and three key/value heads make pieces of
 * 256 and 16 keys, dealt 528 : 288 keys a row, where two blocks of 8 rows run 3 : 3 jobs. One
 * thread takes whole jobs: no pieces, and no mask to read for them. */
static JobPlan plan_pass(int n_q, int n_heads, int n_kv_heads, int head_dim, int n_keys, size_t head_bytes,
                         const uint8_t *visible, int threads) {
    int max_rows = rows_share_jobs(n_q, head_bytes) ? ROW_BLOCK : 1;
    int units = threads > 1 ? pieces_of(seen_by_every_row(visible, n_q, n_keys), n_keys) : 0;
    JobPlan pieces = plan_jobs(n_q, n_heads, n_kv_heads, head_dim, threads, max_rows, units);
    if (pieces.pieces == 1) return pieces;
    JobPlan whole = plan_jobs(n_q, n_heads, n_kv_heads, head_dim, threads, max_rows, 0);
    return heaviest_thread(&whole, n_keys, threads) < heaviest_thread(&pieces, n_keys, threads) ? whole : pieces;
}

/* The plan the float32 kernel makes for a pass (for tests and scripts): {jobs, pieces, blocks of
 * rows, shares of heads, the busiest thread's rows x queries x keys}. */
void decodekit_attention_plan(int n_q, int n_heads, int n_kv_heads, int head_dim, int n_keys, const uint8_t *visible,
                              int threads, int64_t *out) {
    JobPlan p = plan_pass(n_q, n_heads, n_kv_heads, head_dim, n_keys, (size_t)n_keys * head_dim * sizeof(float) * 2,
                          visible, threads);
    out[0] = p.jobs, out[1] = p.pieces, out[2] = p.blocks, out[3] = p.shares;
    out[4] = heaviest_thread(&p, n_keys, threads > 0 ? threads : 1);
}

/* Job `index` of plan p. A whole job keeps its segments in the thread's scratch s; a piece in
 * `pieces` ([n_q][n_heads][segments_of(n_keys)][segment_slot]). */
static inline void job_of(const JobPlan *p, int index, const float *q, float *out, const uint8_t *visible, int n_keys,
                          Scratch *s, float *pieces, Job *job) {
    JobSpan j = span_of(p, index, n_keys);
    job->whole = p->pieces == 1;
    job->lo = j.lo, job->hi = j.hi;
    size_t slot = segment_slot(p->head_dim), slots = (size_t)segments_of(n_keys) * slot; /* a query's, in pieces */
    job->kv = j.kv;
    job->count = j.count;
    job->rows = j.rows, job->first_row = j.first_row;
    for (int r = 0; r < job->rows; r++) {
        size_t row = (size_t)(j.first_row + r);
        job->vis[r] = visible ? visible + row * n_keys : NULL;
        for (int m = 0; m < job->count; m++) {
            job->q[r][m] = q + (row * p->n_heads + j.first + m) * p->head_dim;
            job->out[r][m] = out + (row * p->n_heads + j.first + m) * p->head_dim;
            job->part[r][m] = job->whole ? s->row[r].part + (size_t)m * s->segments * slot
                                         : pieces + (row * p->n_heads + j.first + m) * slots + (size_t)j.first_unit * slot;
        }
    }
}

/* Which compiled job takes `count` queries of head size 16 * `chunks` (the caller's case labels
 * come from JOB_CASES): 1 to 4 queries at head size 64, 1 or 2 at 128, else the general job, one
 * query at a time with the head size counted at run time. */
static inline int job_kind(int chunks, int count) { return chunks == 4 ? count : chunks == 8 ? 10 + count : 0; }
#define JOB_CASES(PREFIX, ...)                                                                      \
    case 1: PREFIX##_q1_c4(__VA_ARGS__); break;                                                     \
    case 2: PREFIX##_q2_c4(__VA_ARGS__); break;                                                     \
    case 3: PREFIX##_q3_c4(__VA_ARGS__); break;                                                     \
    case 4: PREFIX##_q4_c4(__VA_ARGS__); break;                                                     \
    case 11: PREFIX##_q1_c8(__VA_ARGS__); break;                                                    \
    case 12: PREFIX##_q2_c8(__VA_ARGS__); break;

/* The scaled scores of the `count` (1..16) keys waiting for each of `queries` queries of a row,
 * stored from score n on; over an int8 cache (`scaled`) times their keys' row scales first. */
static inline void store_scores(RowState *rs, int queries, int n, int count, float scale, int scaled) {
    __mmask16 mask = first_lanes(count);
    for (int m = 0; m < queries; m++) {
        __m512 sums = sum_lanes16(rs->waiting + 16 * m);
        if (scaled) sums = _mm512_mul_ps(sums, _mm512_maskz_loadu_ps(mask, rs->row_scales));
        _mm512_mask_storeu_ps(rs->scores + m * rs->stride + n, mask, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
    }
}

/* In a job over Q queries with registers qv[m][c] and a key in kv[c], for row `rs` with n scores
 * stored and `held` products waiting: each query's product with the key waits in its slot
 * SLOT(held) until 16 keys are in, then they become 16 scores at once. */
#define SCORE_KEY(Q, CH, position, SCALED)                                                          \
    do {                                                                                            \
        for (int m = 0; m < Q; m++) {                                                               \
            __m512 acc = _mm512_mul_ps(qv[m][0], kv[0]);                                            \
            for (int c = 1; c < (CH); c++) acc = _mm512_fmadd_ps(qv[m][c], kv[c], acc);             \
            rs->waiting[16 * m + SLOT(held)] = acc;                                                 \
        }                                                                                           \
        rs->keys[n + held] = (position);                                                            \
        if (++held == 16) {                                                                         \
            store_scores(rs, Q, n, 16, scale, SCALED);                                              \
            n += 16, held = 0;                                                                      \
        }                                                                                           \
    } while (0)

/* A row's scores (its waiting products stored first) replaced, segment by segment, by their
 * softmax numerators within the segment; query m's segment k gets m_k and l_k in its slot
 * part[m] + k * segment_slot (slot k of the row's first segment in the job). */
static inline void finish_segments(RowState *rs, int queries, float scale, int scaled, float *const *part, int head_dim) {
    if (rs->held) store_scores(rs, queries, rs->n, rs->held, scale, scaled), rs->n += rs->held, rs->held = 0;
    size_t slot = segment_slot(head_dim);
    for (int m = 0; m < queries; m++)
        for (int t = 0; t < rs->n; t += SEGMENT_KEYS) {
            float *scores = rs->scores + m * rs->stride + t, *at = part[m] + (size_t)(t / SEGMENT_KEYS) * slot + head_dim;
            int count = rs->n - t < SEGMENT_KEYS ? rs->n - t : SEGMENT_KEYS;
            at[0] = largest(scores, count);
            at[1] = softmax_numerators(scores, count, at[0]);
        }
}

/* Where the segment of key t (t counting the row's visible keys, from a segment's start) ends. */
static inline int segment_end(int t, int n) {
    int end = (t / SEGMENT_KEYS + 1) * SEGMENT_KEYS;
    return end < n ? end : n;
}

/* The value sums of `queries` queries (query m's at o + m * o_stride, head_dim / 16 vectors) as
 * segment k's o_k, then set to zero for the next. */
static inline void keep_segment(float *const *part, int k, __m512 *o, int o_stride, int queries, int head_dim) {
    for (int m = 0; m < queries; m++)
        for (int c = 0; c < head_dim / 16; c++) {
            _mm512_storeu_ps(part[m] + (size_t)k * segment_slot(head_dim) + 16 * c, o[m * o_stride + c]);
            o[m * o_stride + c] = _mm512_setzero_ps();
        }
}

/* A query's output from its `segments` segments' results (the header's fold: with one segment,
 * exactly o_0 * (1 / l_0); none: zeros). */
static void fold_segments(const float *part, int segments, int head_dim, float *out) {
    size_t slot = segment_slot(head_dim);
    float best = -INFINITY, total = 0.0f;
    for (int k = 0; k < segments; k++)
        if (part[k * slot + head_dim] > best) best = part[k * slot + head_dim];
    __m512 o[16];
    for (int c = 0; c < head_dim / 16; c++) o[c] = _mm512_setzero_ps();
    for (int k = 0; k < segments; k++) {
        const float *at = part + k * slot;
        float w = expf(at[head_dim] - best);
        total = fmaf(w, at[head_dim + 1], total);
        for (int c = 0; c < head_dim / 16; c++) o[c] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(at + 16 * c), o[c]);
    }
    __m512 inverse = _mm512_set1_ps(segments ? 1.0f / total : 0.0f);
    for (int c = 0; c < head_dim / 16; c++) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(o[c], inverse));
}

/* In a job over Q queries with accumulators o[m][c] and a value row in vv[c]: each query adds the
 * row times its weight (WEIGHT, an expression of m), to the sums of its segment (keep_segment). */
#define ADD_VALUE_ROW(Q, CH, WEIGHT)                                                                \
    for (int m = 0; m < Q; m++) {                                                                   \
        __m512 p = _mm512_set1_ps(WEIGHT);                                                          \
        for (int c = 0; c < (CH); c++) o[m][c] = _mm512_fmadd_ps(p, vv[c], o[m][c]);                \
    }

/* The int8 cache (kv cache "int8"): each (head, slot) row is head_dim int8 values then their
 * float32 scale (row bytes head_dim + 4), value = scale * q. Written by layer_ops.c's
 * decodekit_rope_store_q8 and read by the same jobs as the float caches: scores q . k_int summed
 * 16 lanes at once, times the row's scale, then the softmax scale; values the sum of (p scale_v)
 * v_int in key order. */
static inline __m512 load_q8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }

/* x[i] <- column i of the 16 x 16 matrix whose rows are x[0..15]. */
static inline __attribute__((always_inline)) void transpose16(__m512 *x) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(x[i], x[i + 1]), t[i + 1] = _mm512_unpackhi_ps(x[i], x[i + 1]);
    for (int i = 0; i < 16; i += 4) {
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        x[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), x[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        x[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d)), x[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    /* x[4a + b], 128-bit lane k: rows 4a..4a+3 of column 4k + b */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(x[i], x[i + 4], 0x88), t[i + 4] = _mm512_shuffle_f32x4(x[i], x[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(x[i + 8], x[i + 12], 0x88), t[i + 12] = _mm512_shuffle_f32x4(x[i + 8], x[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), x[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
}

/* Keys j0 .. j1 - 1 (at most TILE_KEYS) of a head as float32 (keys past j1 in the last block of
 * 16: zeros), their row scales (SCALED) at kscale[j - j0]. On AVX-512 each block of 16 keys is
 * transposed: in block b, value d of the block's key t at kt[(b * dims + d) * 16 + t]; on AVX2
 * the keys stay rows, key t of block b at kt[(b * 16 + t) * dims] (tile_scores), and a whole
 * block of float32 rows is not copied but read in the cache (TILE_BLOCK says where a block is). */
#define TILE_SCALES(SCALED, CH)                                                                     \
        if (SCALED)                                                                                 \
            for (int t = 0; t < 16; t++) {                                                          \
                float v = 0.0f;                                                                     \
                if (t < count) memcpy(&v, kh + (size_t)(b + t) * row + 16 * (CH), sizeof(float));  \
                s->kscale[b - j0 + t] = v;                                                          \
            }
#ifdef __AVX512F__
#define PREPARE_TILE(T, LOAD, SCALED, CH)                                                         \
    for (int b = j0; b < j1; b += 16) {                                                             \
        int count = j1 - b < 16 ? j1 - b : 16;                                                      \
        float *kb = s->kt + (size_t)(b - j0) * 16 * (CH);                                           \
        ask_for(kh + (size_t)(b + 32) * row, 16 * row * sizeof(T));                                 \
        for (int c = 0; c < (CH); c++) {                                                            \
            __m512 x[16];                                                                           \
            for (int t = 0; t < 16; t++) x[t] = t < count ? LOAD(kh + (size_t)(b + t) * row + 16 * c) : _mm512_setzero_ps(); \
            transpose16(x);                                                                         \
            for (int i = 0; i < 16; i++) _mm512_store_ps(kb + (16 * c + i) * 16, x[i]);            \
        }                                                                                           \
        TILE_SCALES(SCALED, CH)                                                                     \
    }
#define TILE_BLOCK(T, SCALED, CH, b) (s->kt + (size_t)((b) - j0) * 16 * (CH))
#else
/* float32 rows are read where they are, but for a last block of under 16 keys (padded with zeros) */
#define READ_IN_PLACE(T, SCALED, b) (sizeof(T) == 4 && !(SCALED) && j1 - (b) >= 16)
#define TILE_BLOCK(T, SCALED, CH, b)                                                                \
    (READ_IN_PLACE(T, SCALED, b) ? (const float *)(const void *)(kh + (size_t)(b) * row) : s->kt + (size_t)((b) - j0) * 16 * (CH))
#define PREPARE_TILE(T, LOAD, SCALED, CH)                                                           \
    for (int b = j0; b < j1; b += 16) {                                                             \
        int count = j1 - b < 16 ? j1 - b : 16;                                                      \
        float *kb = s->kt + (size_t)(b - j0) * 16 * (CH);                                           \
        ask_for(kh + (size_t)(b + 32) * row, 16 * row * sizeof(T));                                 \
        if (READ_IN_PLACE(T, SCALED, b)) continue;                                                  \
        for (int t = 0; t < 16; t++)                                                                \
            for (int c = 0; c < (CH); c++)                                                          \
                _mm512_store_ps(kb + (size_t)t * 16 * (CH) + 16 * c,                                \
                                t < count ? LOAD(kh + (size_t)(b + t) * row + 16 * c) : _mm512_setzero_ps()); \
        TILE_SCALES(SCALED, CH)                                                                     \
    }
#endif

/* The 16 scores of query q against a block of 16 transposed keys (PREPARE_TILE's layout: value d
 * of key t at kb[16 d + t]), before scaling: lane t of a[l] runs the products of lane l of key t's
 * own 16-lane sum (q[l] k[l], then q[16c + l] k[16c + l] added by fused multiply-adds, c in order),
 * and the a[l] are added in _mm512_reduce_add_ps's pairing (8 apart, then 4, 2, 1). */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) __m512 transposed_scores(const float *q, const float *kb, int chunks) {
    __m512 a[16];
    for (int l = 0; l < 16; l++) a[l] = _mm512_mul_ps(_mm512_set1_ps(q[l]), _mm512_load_ps(kb + 16 * l));
    for (int c = 1; c < chunks; c++)
        for (int l = 0; l < 16; l++) a[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[16 * c + l]), _mm512_load_ps(kb + 16 * (16 * c + l)), a[l]);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) a[l] = _mm512_add_ps(a[l], a[l + w]);
    return a[0];
}
static inline __attribute__((always_inline)) void tile_scores_all(const float *const *q, int count, const float *kb, int chunks, __m512 *e) {
    for (int m = 0; m < count; m++) e[m] = transposed_scores(q[m], kb, chunks);
}
#else
/* On AVX2 the same sums from the keys as rows (PREPARE_TILE), a query's 64 values in registers:
 * key t's 16-lane products are two 8-lane halves (lanes l and l + 8), whose sum is the first
 * level of the pairing; the next three (4, 2, 1 apart) are taken across 8 keys at once by
 * shuffles, which leave key t in lane t. (Transposed, each multiply-add would need a broadcast and
 * a load, and the sixteen partial sums would not fit the sixteen registers.) */
static inline __attribute__((always_inline)) __m256 key_pairs8(const __m256 *qv, const float *k, int chunks) {
    __m256 lo = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k)), hi = _mm256_mul_ps(qv[1], _mm256_loadu_ps(k + 8));
    for (int c = 1; c < chunks; c++) {
        lo = _mm256_fmadd_ps(qv[2 * c], _mm256_loadu_ps(k + 16 * c), lo);
        hi = _mm256_fmadd_ps(qv[2 * c + 1], _mm256_loadu_ps(k + 16 * c + 8), hi);
    }
    return _mm256_add_ps(lo, hi);
}
/* keys t and t + 4 of 8 (rows `stride` floats apart): lanes 4 apart added, key t's in the low half */
static inline __attribute__((always_inline)) __m256 key_quads8(const __m256 *qv, const float *k, size_t stride, int t, int chunks) {
    __m256 x = key_pairs8(qv, k + t * stride, chunks), y = key_pairs8(qv, k + (t + 4) * stride, chunks);
    return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}
static inline __attribute__((always_inline)) __m256 halves_added(__m256 x, __m256 y) { /* lanes 2 apart */
    return _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
}
static inline __attribute__((always_inline)) __m256 tile_scores8(const __m256 *qv, const float *k, int chunks) {
    size_t stride = 16 * (size_t)chunks;
    __m256 x01 = halves_added(key_quads8(qv, k, stride, 0, chunks), key_quads8(qv, k, stride, 1, chunks));
    __m256 x23 = halves_added(key_quads8(qv, k, stride, 2, chunks), key_quads8(qv, k, stride, 3, chunks));
    return _mm256_add_ps(_mm256_shuffle_ps(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline __attribute__((always_inline)) void tile_scores_all(const float *const *q, int count, const float *kb, int chunks, __m512 *e) {
    for (int m = 0; m < count; m++) {
        __m256 qv[32]; /* head size up to 256 */
        for (int i = 0; i < 2 * chunks; i++) qv[i] = _mm256_loadu_ps(q[m] + 8 * i);
        e[m] = (__m512){tile_scores8(qv, kb, chunks), tile_scores8(qv, kb + 8 * 16 * (size_t)chunks, chunks)};
        /* a compiler barrier: the next query loads the keys again from the cache, where GCC would
         * keep all 128 key vectors for it and spill them to the stack, a copy of the block per row */
        __asm__ volatile("" ::: "memory");
    }
}
#endif

/* Row r's scores over a tile (PREPARE_TILE), 16 keys a block (tile_scores_all): each key's score
 * has the bits of the one-row arithmetic (SCORE_KEY, then sum_lanes16). The row's visible keys of
 * the block are appended, in order, to its scores and keys (a block it sees whole: as they are). */
#define SCORE_TILE(T, SCALED, Q, CH)                                                                \
    do {                                                                                            \
        RowState *rs = &s->row[r];                                                                  \
        const uint8_t *vis = job->vis[r];                                                           \
        int n = rs->n;                                                                              \
        for (int b = j0; b < j1; b += 16) {                                                         \
            __mmask16 seen = first_lanes(j1 - b);                                                   \
            if (vis) {                                                                              \
                __m128i bytes = _mm_maskz_loadu_epi8(seen, vis + b);                                \
                seen = _mm_test_epi8_mask(bytes, bytes);                                            \
            }                                                                                       \
            if (!seen) continue;                                                                    \
            const float *kb = TILE_BLOCK(T, SCALED, CH, b);                                         \
            { /* the next tile's block b, a share of it from each row: the memory's work spread over theirs */ \
                size_t bytes_ = 16 * row * sizeof(T), share_ = (bytes_ / 64 + job->rows - 1) / job->rows * 64; \
                size_t from_ = (size_t)r * share_;                                                  \
                if (from_ < bytes_)                                                                 \
                    ask_for_later((const char *)(kh + (size_t)(b + TILE_KEYS) * row) + from_, bytes_ - from_ < share_ ? bytes_ - from_ : share_); \
            }                                                                                       \
            int count = __builtin_popcount(seen);                                                   \
            __mmask16 packed = first_lanes(count);                                                  \
            __m512 es[Q];                                                                           \
            tile_scores_all(job->q[r], Q, kb, (CH), es);                                            \
            for (int m = 0; m < Q; m++) {                                                           \
                __m512 e = es[m];                                                                   \
                if (SCALED) e = _mm512_mul_ps(e, _mm512_loadu_ps(s->kscale + (b - j0)));            \
                e = _mm512_mul_ps(e, _mm512_set1_ps(scale));                                        \
                if (seen != 0xFFFF) e = _mm512_maskz_compress_ps(seen, e); /* all seen: in place */ \
                _mm512_mask_storeu_ps(rs->scores + m * rs->stride + n, packed, e);                  \
            }                                                                                       \
            __m512i at = _mm512_add_epi32(_mm512_set1_epi32(b), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)); \
            _mm512_mask_storeu_epi32(rs->keys + n, packed, seen == 0xFFFF ? at : _mm512_maskz_compress_epi32(seen, at)); \
            n += count;                                                                             \
        }                                                                                           \
        rs->n = n;                                                                                  \
    } while (0)

/* Row rs's keys t .. (the first of them at or past j1) - 1 added to its value sums (rs->o), the
 * values of key keys[t] weighted by each query's softmax numerator, one key after another in
 * order (t is left at the first key not added). A row of a job asks for every rows-th key's
 * values of the next tile (turn_). On AVX-512 every query's sums stay in registers while each
 * value row is read once for them all. AVX2's 16 registers hold one query's 64-value sums, not
 * three (they spill: a load and a store a multiply-add), so in a job of several rows, whose
 * arithmetic bounds it, or over a short cache, the queries go over the keys in turn (two at a
 * time over half the values each, for a head size of 64), 32 keys at a time (VALUE_TILE) so that
 * the values are read from the first-level cache after the first query. A job of one row over a
 * long cache is bound by reading it and keeps the one pass. Every sum gets the same operations in
 * the same order either way. */
#define VALUE_PREFETCH(T, i)                                                                        \
    if (r == 0 && (i) + AHEAD < n) ask_for(vh + (size_t)keys[(i) + AHEAD] * row, row * sizeof(T));  \
    if (job->rows > 1 && turn_ == r) ask_for_later(vh + (size_t)(keys[i] + TILE_KEYS) * row, row * sizeof(T)); \
    if (++turn_ == job->rows) turn_ = 0;
/* value row vj's scale (int8 rows: after the values), and query m's weight of key t */
#define VALUE_SCALE(SCALED, CH)                                                                     \
    float vscale = 1.0f;                                                                            \
    if (SCALED) memcpy(&vscale, vj + 16 * (CH), sizeof(float));
#define VALUE_WEIGHT(SCALED, m, t) (SCALED ? scores[(m) * stride + (t)] * vscale : scores[(m) * stride + (t)])
#define ADD_VALUES_AT_ONCE(T, LOAD, SCALED, Q, CH)                                                  \
    for (int m = 0; m < Q; m++)                                                                     \
        for (int c = 0; c < (CH); c++) o[m][c] = rs->o[16 * m + c];                                 \
    int turn_ = t % job->rows;                                                                      \
    for (; t < stop && keys[t] < j1; t++) {                                                         \
        VALUE_PREFETCH(T, t)                                                                        \
        const T *vj = vh + (size_t)keys[t] * row;                                                   \
        VALUE_SCALE(SCALED, CH)                                                                     \
        for (int c = 0; c < (CH); c++) vv[c] = LOAD(vj + 16 * c);                                   \
        ADD_VALUE_ROW(Q, CH, VALUE_WEIGHT(SCALED, m, t))                                            \
    }                                                                                               \
    for (int m = 0; m < Q; m++)                                                                     \
        for (int c = 0; c < (CH); c++) rs->o[16 * m + c] = o[m][c];
#ifdef __AVX512F__
#define VALUE_TILE(T, tile) (tile)
#define ADD_VALUES ADD_VALUES_AT_ONCE
#else
/* a job of one row over a head's values too large for the second-level cache */
#define VALUES_AT_ONCE(T) (job->rows == 1 && (size_t)n_keys * row * sizeof(T) >= ((size_t)256 << 10))
#define VALUE_TILE(T, tile) (VALUES_AT_ONCE(T) ? (tile) : 32)
/* Queries m and m + 1 of a head of 64 values, half of it at a time (their 2 x 32 sums take 8 of the
 * 16 registers): each value vector is loaded once for both, half the loads of a query at a time. */
#define ADD_VALUES_OF_TWO(T, LOAD, SCALED, CH)                                                      \
    for (int half = 0; half < 2; half++) {                                                          \
        __m512 s0[2], s1[2];                                                                        \
        for (int c = 0; c < 2; c++) s0[c] = rs->o[16 * m + 2 * half + c], s1[c] = rs->o[16 * (m + 1) + 2 * half + c]; \
        for (int u = t; u < end_; u++) {                                                            \
            const T *vj = vh + (size_t)keys[u] * row;                                               \
            VALUE_SCALE(SCALED, CH)                                                                 \
            __m512 p0 = _mm512_set1_ps(VALUE_WEIGHT(SCALED, m, u)), p1 = _mm512_set1_ps(VALUE_WEIGHT(SCALED, m + 1, u)); \
            for (int c = 0; c < 2; c++) {                                                           \
                __m512 v = LOAD(vj + 16 * (2 * half + c));                                          \
                s0[c] = _mm512_fmadd_ps(p0, v, s0[c]), s1[c] = _mm512_fmadd_ps(p1, v, s1[c]);       \
            }                                                                                       \
        }                                                                                           \
        for (int c = 0; c < 2; c++) rs->o[16 * m + 2 * half + c] = s0[c], rs->o[16 * (m + 1) + 2 * half + c] = s1[c]; \
    }
#define ADD_VALUES(T, LOAD, SCALED, Q, CH)                                                          \
    if (VALUES_AT_ONCE(T)) { /* bound by reading the cache: each value row read once */            \
        ADD_VALUES_AT_ONCE(T, LOAD, SCALED, Q, CH)                                                  \
    } else {                                                                                        \
        int end_ = t, turn_ = t % job->rows;                                                        \
        for (; end_ < stop && keys[end_] < j1; end_++) { VALUE_PREFETCH(T, end_) }                  \
        int m = 0;                                                                                  \
        if ((CH) == 4) /* head size 64: two queries at once, each value vector loaded for both */    \
            for (; m + 1 < Q; m += 2) ADD_VALUES_OF_TWO(T, LOAD, SCALED, CH)                         \
        for (; m < Q; m++) {                                                                        \
            __m512 sums[(CH)];                                                                      \
            for (int c = 0; c < (CH); c++) sums[c] = rs->o[16 * m + c];                             \
            for (int u = t; u < end_; u++) {                                                        \
                const T *vj = vh + (size_t)keys[u] * row;                                           \
                VALUE_SCALE(SCALED, CH)                                                             \
                __m512 p = _mm512_set1_ps(VALUE_WEIGHT(SCALED, m, u));                              \
                for (int c = 0; c < (CH); c++) sums[c] = _mm512_fmadd_ps(p, LOAD(vj + 16 * c), sums[c]); \
            }                                                                                       \
            for (int c = 0; c < (CH); c++) rs->o[16 * m + c] = sums[c];                             \
        }                                                                                           \
        t = end_;                                                                                   \
    }
#endif

/* One job (Job: rows, and Q queries a row that read the same key/value head), over keys and
 * values of type T read with LOAD (SCALED: int8 rows with their scale after them). CH = head_dim /
 * 16: a constant (everything stays in registers), or the run-time `chunks_` (then Q = 1).
 *
 * Keys are taken a tile at a time (`tile` keys; all of them where the job has one row), and each
 * row of the job goes over the tile before the next tile is read: a tile is read from memory once
 * for all the rows. A job of one row scores key after key (SCORE_KEY); one of several rows scores
 * each tile from PREPARE_TILE (SCORE_TILE). Each row's arithmetic is exactly what
 * it would be alone, key after key in cache order (between tiles its value sums wait in its
 * RowState), a segment at a time, so no result depends on the tiles, the rows or the heads
 * beside it. A piece of a row's segments (cache slots lo .. hi - 1, which start a segment) gets
 * their results as the whole row would. */
#define DEFINE_JOB(NAME, T, LOAD, SCALED, Q, CH)                                                    \
    static void NAME(const Job *job, const T *kh, const T *vh, int n_keys, int chunks_, int tile, float scale,  \
                     Scratch *s) {                                                                  \
        (void)chunks_;                                                                              \
        const size_t row = 16 * (size_t)(CH) + (SCALED ? 4 / sizeof(T) : 0);                        \
        __m512 vv[16], o[Q][16];                                                                    \
        for (int r = 0; r < job->rows; r++) s->row[r].n = s->row[r].held = s->row[r].t = 0;         \
        for (int j0 = job->lo; j0 < job->hi; j0 += tile) { /* the scores */                         \
            int j1 = job->hi - j0 > tile ? j0 + tile : job->hi;                                     \
            if (job->rows > 1) { /* the tile prepared once, for every row and query */              \
                PREPARE_TILE(T, LOAD, SCALED, CH)                                                   \
                for (int r = 0; r < job->rows; r++) SCORE_TILE(T, SCALED, Q, CH);                   \
                continue;                                                                           \
            }                                                                                       \
            for (int r = 0; r < job->rows; r++) {                                                   \
                RowState *rs = &s->row[r];                                                          \
                int n = rs->n, held = rs->held;                                                     \
                __m512 qv[Q][16], kv[16];                                                           \
                for (int m = 0; m < Q; m++)                                                         \
                    for (int c = 0; c < (CH); c++) qv[m][c] = _mm512_loadu_ps(job->q[r][m] + 16 * c); \
                FOR_EACH_VISIBLE(j, job->vis[r], j0, j1) {                                          \
                    const T *kj = kh + (size_t)j * row;                                             \
                    if (j + AHEAD < n_keys) ask_for(kj + AHEAD * row, row * sizeof(T));             \
                    for (int c = 0; c < (CH); c++) kv[c] = LOAD(kj + 16 * c);                       \
                    if (SCALED) memcpy(&rs->row_scales[held], kj + 16 * (CH), sizeof(float));       \
                    SCORE_KEY(Q, CH, j, SCALED);                                                    \
                }                                                                                   \
                rs->n = n, rs->held = held;                                                         \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < job->rows; r++) {                                                       \
            finish_segments(&s->row[r], Q, scale, SCALED, job->part[r], 16 * (CH));                 \
            for (int i = 0; i < 16 * Q; i++) s->row[r].o[i] = _mm512_setzero_ps();                  \
        }                                                                                           \
        for (int j0 = job->lo; j0 < job->hi; j0 += VALUE_TILE(T, tile)) { /* the values, tile by tile */ \
            int j1 = job->hi - j0 > VALUE_TILE(T, tile) ? j0 + VALUE_TILE(T, tile) : job->hi;             \
            for (int r = 0; r < job->rows; r++) {                                                   \
                RowState *rs = &s->row[r];                                                          \
                const int *keys = rs->keys;                                                         \
                const float *scores = rs->scores;                                                   \
                size_t stride = rs->stride;                                                         \
                int t = rs->t, n = rs->n;                                                           \
                while (t < n && keys[t] < j1) { /* up to the tile's end or the segment's */         \
                    int stop = segment_end(t, n);                                                   \
                    ADD_VALUES(T, LOAD, SCALED, Q, CH)                                              \
                    if (t == stop) keep_segment(job->part[r], (t - 1) / SEGMENT_KEYS, rs->o, 16, Q, 16 * (CH)); \
                }                                                                                   \
                rs->t = t;                                                                          \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; job->whole && r < job->rows; r++)                                           \
            for (int m = 0; m < Q; m++) fold_segments(job->part[r][m], segments_of(s->row[r].n), 16 * (CH), job->out[r][m]); \
    }

/* A pass (plan_jobs). Each job reads its group's keys and values, and reading the cache bounds a
 * decode step's attention, so a pass over three groups on two threads cuts each group's keys into
 * pieces (pieces_of) rather than halving each group's heads (which read every key and value
 * twice); the pieces' results are folded once every job is done, each row's by how many keys it
 * sees. A head size the compiled jobs do not cover runs one query at a time (the general job). */
#define DEFINE_ATTENTION(NAME, T, LOAD, SCALED)                                                     \
    DEFINE_JOB(NAME##_q1_c4, T, LOAD, SCALED, 1, 4)                                                 \
    DEFINE_JOB(NAME##_q2_c4, T, LOAD, SCALED, 2, 4)                                                 \
    DEFINE_JOB(NAME##_q3_c4, T, LOAD, SCALED, 3, 4)                                                 \
    DEFINE_JOB(NAME##_q4_c4, T, LOAD, SCALED, 4, 4)                                                 \
    DEFINE_JOB(NAME##_q1_c8, T, LOAD, SCALED, 1, 8)                                                 \
    DEFINE_JOB(NAME##_q2_c8, T, LOAD, SCALED, 2, 8)                                                 \
    DEFINE_JOB(NAME##_one, T, LOAD, SCALED, 1, chunks_)                                             \
    void NAME(const float *q, const T *k, const T *v, const uint8_t *visible, float *out,            \
              int n_q, int n_heads, int n_kv_heads, int head_dim, int cap, int n_keys,               \
              float scale, int threads) {                                                           \
        int chunks = head_dim / 16;                                                                 \
        size_t row = (size_t)head_dim + (SCALED ? 4 / sizeof(T) : 0);                               \
        if (n_q <= 0) return; /* no rows: no jobs */                                                \
        int segments = segments_of(n_keys);                                                         \
        JobPlan plan = plan_pass(n_q, n_heads, n_kv_heads, head_dim, n_keys, (size_t)n_keys * row * sizeof(T) * 2, visible, threads); \
        float *pieces = NULL;                                                                       \
        if (plan.pieces > 1 && !(pieces = malloc(sizeof(float) * n_q * n_heads * segments * segment_slot(head_dim)))) \
            plan = plan_jobs(n_q, n_heads, n_kv_heads, head_dim, threads, plan.max_rows, 0); /* no memory: whole */ \
        int rows = (n_q + plan.blocks - 1) / plan.blocks;                                           \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)")                               \
        {                                                                                           \
            flush_denormals();                                                                      \
            Scratch s;                                                                              \
            scratch_init(&s, rows, (size_t)n_keys, head_dim);                                       \
            _Pragma("omp for schedule(static)")                                                     \
            for (int index = 0; index < plan.jobs; index++) {                                       \
                Job job;                                                                            \
                job_of(&plan, index, q, out, visible, n_keys, &s, pieces, &job);                    \
                const T *kh = k + (size_t)job.kv * cap * row, *vh = v + (size_t)job.kv * cap * row; \
                int span = job.rows > 1 ? TILE_KEYS : n_keys;                                       \
                switch (job_kind(chunks, job.count)) {                                              \
                JOB_CASES(NAME, &job, kh, vh, n_keys, chunks, span, scale, &s)                      \
                default:                                                                            \
                    for (int m = 0; m < job.count; m++) {                                           \
                        Job one = job;                                                              \
                        one.count = 1;                                                              \
                        for (int r = 0; r < job.rows; r++)                                          \
                            one.q[r][0] = job.q[r][m], one.out[r][0] = job.out[r][m], one.part[r][0] = job.part[r][m]; \
                        NAME##_one(&one, kh, vh, n_keys, chunks, span, scale, &s);                  \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            if (pieces) { /* every piece done (the loop's barrier): each query's segments folded */ \
                int counted = -1, seen = 0; /* the row whose visible keys `seen` counts */          \
                _Pragma("omp for schedule(static)")                                                 \
                for (int i = 0; i < n_q * n_heads; i++) {                                           \
                    if (i / n_heads != counted)                                                     \
                        counted = i / n_heads, seen = visible_count(visible ? visible + (size_t)counted * n_keys : NULL, n_keys); \
                    fold_segments(pieces + (size_t)i * segments * segment_slot(head_dim), segments_of(seen), head_dim, out + (size_t)i * head_dim); \
                }                                                                                   \
            }                                                                                       \
            scratch_free(&s);                                                                       \
        }                                                                                           \
        free(pieces);                                                                               \
    }

DEFINE_ATTENTION(decodekit_attention_f32, float, load_f32, 0)
DEFINE_ATTENTION(decodekit_attention_bf16, uint16_t, load_bf16, 0)
DEFINE_ATTENTION(decodekit_attention_q8, int8_t, load_q8, 1)

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
static inline __attribute__((always_inline)) void load_codes(const uint8_t *p, __m512 *out, int chunks, int bits) {
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

/* One job: Q queries (rows q[m], outputs out[m], segment results part[m]: job_of's) of one row
 * that share a key/value head, CH = head_dim / 16 (a constant where registers hold them all, else
 * a variable). Each key and value is rebuilt once for all Q; each query's arithmetic is what it
 * would be alone. */
#define DEFINE_KIVI_JOB(NAME, Q, CH_PARAM, CH)                                                      \
    static void NAME(const float *const *q, float *const *out, float *const *part, const KiviHead *h, \
                     const uint8_t *vis, int CH_PARAM, float scale, Scratch *s) {                   \
        (void)chunks_;                                                                              \
        const int row_bytes = 2 * h->bits * (CH);                                                   \
        __m512 qv[Q][CH], ks[CH], km[CH], kv[CH];                                                   \
        for (int m = 0; m < Q; m++)                                                                 \
            for (int c = 0; c < (CH); c++) qv[m][c] = _mm512_loadu_ps(q[m] + 16 * c);               \
        RowState *rs = &s->row[0];                                                                  \
        int n = 0, held = 0;                                                                        \
        for (int c = 0; c < (CH); c++) ks[c] = km[c] = _mm512_setzero_ps();                         \
        for (int j = 0; j < h->end; j++) { /* the codes: positions 0 .. end - 1 */                  \
            if (j % h->group == 0) {                                                                \
                const float *p = h->kp + (size_t)(j / h->group) * 2 * 16 * (CH);                   \
                for (int c = 0; c < (CH); c++)                                                      \
                    ks[c] = _mm512_loadu_ps(p + 16 * c), km[c] = _mm512_loadu_ps(p + 16 * ((CH) + c)); \
            }                                                                                       \
            load_codes(h->kc + (size_t)j * row_bytes, kv, (CH), h->bits);                           \
            for (int c = 0; c < (CH); c++) kv[c] = _mm512_fmadd_ps(kv[c], ks[c], km[c]);            \
            SCORE_KEY(Q, CH, j, 0);                                                                 \
        }                                                                                           \
        FOR_EACH_VISIBLE(slot, vis, 0, h->n_residual) { /* the residual, from the row's quantised end on */ \
            if (h->base + slot < h->end) continue;                                                  \
            const float *kj = h->kb + (size_t)slot * 16 * (CH);                                     \
            for (int c = 0; c < (CH); c++) kv[c] = _mm512_loadu_ps(kj + 16 * c);                    \
            SCORE_KEY(Q, CH, h->base + slot, 0);                                                    \
        }                                                                                           \
        rs->n = n, rs->held = held;                                                                 \
        finish_segments(rs, Q, scale, 0, part, 16 * (CH));                                          \
        n = rs->n;                                                                                  \
        __m512 o[Q][CH], vv[CH];                                                                    \
        for (int m = 0; m < Q; m++)                                                                 \
            for (int c = 0; c < (CH); c++) o[m][c] = _mm512_setzero_ps();                           \
        for (int t = 0; t < n; t++) {                                                               \
            int position = rs->keys[t];                                                              \
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
            ADD_VALUE_ROW(Q, CH, rs->scores[m * rs->stride + t])                                    \
            if (t + 1 == segment_end(t, n)) keep_segment(part, t / SEGMENT_KEYS, &o[0][0], (CH), Q, 16 * (CH)); \
        }                                                                                           \
        for (int m = 0; m < Q; m++) fold_segments(part[m], segments_of(n), 16 * (CH), out[m]);      \
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
    JobPlan plan = plan_jobs(n_q, n_heads, n_kv_heads, head_dim, 2 * threads, 1, 0);
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        flush_denormals();
        Scratch s;
        scratch_init(&s, 1, (size_t)cap_q + n_residual, head_dim);
        _Pragma("omp for schedule(static)")
        for (int index = 0; index < plan.jobs; index++) {
            Job job;
            job_of(&plan, index, q, out, visible, n_residual, &s, NULL, &job);
            int kv = job.kv, i = job.first_row, count = job.count;
            const float **qs = (const float **)job.q[0];
            float **outs = job.out[0];
            KiviHead h = {k_codes + (size_t)kv * cap_q * row_bytes, v_codes + (size_t)kv * cap_q * row_bytes,
                          k_params + (size_t)kv * (cap_q / group) * 2 * head_dim, v_params + (size_t)kv * cap_q * 2,
                          k_residual + (size_t)kv * cap_residual * head_dim, v_residual + (size_t)kv * cap_residual * head_dim,
                          group, base, qend[i], n_residual, bits};
            const uint8_t *vis = job.vis[0];
            switch (job_kind(chunks, count)) {
            JOB_CASES(kivi, qs, outs, job.part[0], &h, vis, chunks, scale, &s)
            default:
                for (int m = 0; m < count; m++) kivi_one(qs + m, outs + m, job.part[0] + m, &h, vis, chunks, scale, &s);
            }
        }
        scratch_free(&s);
    }
}
