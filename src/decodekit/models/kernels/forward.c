/* Every decoder layer of a few-row pass (a decode step, a verification pass) in one call.
 *
 * The native backend's layer is a dozen kernel calls (norms, projections, rotary embedding and
 * cache write, attention, SiLU gating). Called one by one from Python, each pays Python's
 * dispatch; from here, one call per pass instead of about 300 (docs/BENCHMARKS.md has the
 * times). This file makes exactly the same calls, in the same order, on the same buffers: the
 * kernels are passed in as function pointers (from gemm.c, layer_ops.c, attention.c), so results
 * are bit-identical to the layer-by-layer path, which stays in use for passes of more than
 * MAX_ROWS tokens (long prefills), hidden-state or observed passes, and batches with a 3-D mask.
 * Layers can be skipped (self-speculation drafts), as the Python loop skips them.
 *
 * Per layer, with x the residual stream [rows, hidden] (updated in place) and `pending` the
 * previous layer's MLP output:
 *   h = add_rms_norm(x += pending, attn_norm); qkv = W_qkv h; q = rope_store(qkv -> cache);
 *   a = attention(q, cache) (float32, rounded to the model dtype); h = add_rms_norm(x += W_o a,
 *   mlp_norm); pending = W_down gate_mul(W_gate_up h)   (gate_mul: SiLU or GeLU gating).
 * A Gemma 3 layer adds (where its fields are set): q, k, v as separate matrices; q and k heads
 * RMS-normalised before the rotary embedding; its own rotary table; sliding-window attention;
 * the attention and MLP outputs normalised before they are added (post_attn_norm, post_mlp_norm).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decodekit.h"
#include "simd.h"

static void project(const Projection *p, const void *x, void *y, int rows, int threads) {
    p->fn(p->weights, x, y, rows, (int)p->n_out, (int)p->n_in, threads);
}

/* Layer `layer` of one sequence: rotary embedding and cache write of its rows (from row `first`
 * of qkv). */
static void sequence_rope(const Model *m, const Sequence *q, size_t first, int layer, const char *qkv, char *q_out,
                          const float *freqs) {
    size_t es = (size_t)m->element_size;
    size_t q_width = (size_t)(m->n_heads * m->head_dim), qkv_width = (size_t)((m->n_heads + 2 * m->n_kv_heads) * m->head_dim);
    m->rope_store(qkv + first * qkv_width * es, freqs, q->positions, (float *)q_out + first * q_width,
                  (char *)q->k_cache + (size_t)layer * q->layer_stride * es,
                  (char *)q->v_cache + (size_t)layer * q->layer_stride * es, (int)q->rows, (int)m->n_heads,
                  (int)m->n_kv_heads, (int)m->head_dim, (int)q->cap, (int)q->start);
}

/* What a sliding-window layer of one sequence sees: slots lo.. of its cache, under `visible`
 * ([rows, start + rows - lo], or NULL for all of them). */
typedef struct {
    int64_t lo;
    uint8_t *visible;
} Window;

/* The window of a sequence's pass (as the Python path's NativeGemma3._window): no row sees a slot
 * before lo = min(first position - window + 1, start); a slot j holds position j below start and
 * positions[j - start] from there. Returns 0, or -1 when its mask cannot be allocated. */
static int window_of(const Sequence *q, int64_t window, Window *out) {
    int64_t low = q->positions[0], high = q->positions[0];
    for (int64_t r = 1; r < q->rows; r++) {
        if (q->positions[r] < low) low = q->positions[r];
        if (q->positions[r] > high) high = q->positions[r];
    }
    int64_t lo = low - window + 1 < q->start ? low - window + 1 : q->start;
    out->lo = lo > 0 ? lo : 0;
    out->visible = NULL;
    int64_t n_keys = q->start + q->rows, width = n_keys - out->lo;
    if (high - window < out->lo && !q->visible) return 0; /* every row sees every slot from lo on */
    out->visible = malloc((size_t)(q->rows * width));
    if (!out->visible) return -1;
    for (int64_t r = 0; r < q->rows; r++)
        for (int64_t j = out->lo; j < n_keys; j++) {
            int64_t position = j < q->start ? j : q->positions[j - q->start];
            int seen = q->visible ? q->visible[r * n_keys + j] : 1;
            out->visible[r * width + (j - out->lo)] = (uint8_t)(seen && position > q->positions[r] - window);
        }
    return 0;
}

#define MANY_ROWS 8 /* a sequence's rows in a batched pass from which its attention runs on its own */

/* Layer `layer`'s attention for `n_q` rows of one sequence, from its row `row` (stacked row
 * `first + row`), over its cache (from slot w->lo, under w's mask, for a sliding-window layer). */
static void sequence_attention(const Model *m, const Sequence *q, const Window *w, size_t first, int row, int n_q,
                               int layer, const char *q_in, char *heads, float scale, int threads) {
    size_t es = (size_t)m->element_size, q_width = (size_t)(m->n_heads * m->head_dim);
    int64_t lo = w ? w->lo : 0;
    int n_keys = (int)(q->start + q->rows - lo);
    const uint8_t *visible = w ? w->visible : q->visible;
    size_t at = (first + (size_t)row) * q_width, offset = ((size_t)layer * q->layer_stride + lo * m->head_dim) * es;
    const KiviCodes *c = q->kivi;
    if (c) { /* no sliding windows here (lo == 0): the codes precede every row */
        c->attention((const float *)q_in + at, c->k_codes + layer * c->codes_stride, c->k_params + layer * c->k_params_stride,
                     c->v_codes + layer * c->codes_stride, c->v_params + layer * c->v_params_stride,
                     (const float *)((char *)q->k_cache + offset), (const float *)((char *)q->v_cache + offset),
                     c->qend + row, visible ? visible + (size_t)row * n_keys : NULL, (float *)heads + at, n_q,
                     (int)m->n_heads, (int)m->n_kv_heads, (int)m->head_dim, (int)c->group, (int)c->bits, (int)c->cap_q, (int)q->cap,
                     (int)c->base, n_keys, scale, threads);
        return;
    }
    m->attention((const float *)q_in + at, (char *)q->k_cache + offset, (char *)q->v_cache + offset,
                 visible ? visible + (size_t)row * n_keys : NULL, (float *)heads + at, n_q, (int)m->n_heads,
                 (int)m->n_kv_heads, (int)m->head_dim, (int)q->cap, n_keys, scale, threads);
}

/* Rows of qkv from three separate projections (q [rows, q_width], k, v [rows, kv_width]). */
static void join_qkv(const char *q, const char *k, const char *v, char *qkv, int rows, size_t q_width,
                     size_t kv_width, size_t es) {
    size_t width = q_width + 2 * kv_width;
    for (int r = 0; r < rows; r++) {
        memcpy(qkv + r * width * es, q + r * q_width * es, q_width * es);
        memcpy(qkv + (r * width + q_width) * es, k + r * kv_width * es, kv_width * es);
        memcpy(qkv + (r * width + q_width + kv_width) * es, v + r * kv_width * es, kv_width * es);
    }
}

/* The per-row buffers of a layer, in one arena. */
enum { H, QKV, Q, HEADS, ATTN, O, GATE_UP, ACT, PARTS, BUFFERS };

/* What a pass needs besides its inputs: the buffers, each sequence's first row and each row's
 * sequence (the rows of all sequences are stacked), each sequence's sliding-window view. */
typedef struct {
    int rows, n_seq;
    size_t q_width, kv_width, qkv_width; /* in elements */
    char *arena, *buf[BUFFERS];
    int64_t *starts;
    int *row_sequence;
    Window *windows; /* or NULL: no sliding-window layer in the pass */
} Pass;

static void pass_free(Pass *p) {
    for (int s = 0; p->windows && s < p->n_seq; s++) free(p->windows[s].visible);
    free(p->windows), free(p->arena), free(p->starts), free(p->row_sequence);
}

/* Allocates a pass's scratch memory; 0, or -1 (nothing left allocated) when it cannot. */
static int pass_alloc(Pass *p, const Model *m, const Layer *layers, int n_layers, const Sequence *seqs, int n_seq) {
    memset(p, 0, sizeof *p);
    p->n_seq = n_seq;
    p->starts = malloc(sizeof(int64_t) * (size_t)(n_seq > 0 ? n_seq : 1));
    if (!p->starts) return -1;
    for (int s = 0; s < n_seq; s++) p->starts[s] = p->rows, p->rows += (int)seqs[s].rows;
    p->row_sequence = malloc(sizeof(int) * (size_t)(p->rows > 0 ? p->rows : 1));
    if (!p->row_sequence) return pass_free(p), -1;
    for (int s = 0; s < n_seq; s++)
        for (int64_t r = p->starts[s]; r < p->starts[s] + seqs[s].rows; r++) p->row_sequence[r] = s;
    size_t es = (size_t)m->element_size, r = (size_t)p->rows;
    p->q_width = (size_t)(m->n_heads * m->head_dim), p->kv_width = (size_t)(m->n_kv_heads * m->head_dim);
    p->qkv_width = p->q_width + 2 * p->kv_width;
    size_t sizes[BUFFERS] = {
        [H] = r * m->hidden * es,
        [QKV] = r * p->qkv_width * es,
        [Q] = r * p->q_width * 4,         /* float32 */
        [HEADS] = r * p->q_width * 4,     /* the attention output, float32 */
        [ATTN] = r * p->q_width * es,     /* the same in the model dtype */
        [O] = r * m->hidden * es,
        [GATE_UP] = r * 2 * m->inter * es,
        [ACT] = r * m->inter * es,        /* gate_mul(gate, up) */
        [PARTS] = r * p->qkv_width * es,  /* q, k, v from separate matrices, before they are joined */
    };
    size_t total = 0;
    for (int b = 0; b < BUFFERS; b++) total += (sizes[b] + 63) / 64 * 64;
    p->arena = aligned_alloc(64, total);
    if (!p->arena) return pass_free(p), -1;
    for (size_t b = 0, offset = 0; b < BUFFERS; offset += (sizes[b] + 63) / 64 * 64, b++) p->buf[b] = p->arena + offset;
    if (es == 4) p->buf[ATTN] = p->buf[HEADS]; /* float32: the attention output is already in the model dtype */
    int local = 0;
    for (int i = 0; i < n_layers; i++) local |= layers[i].local != 0;
    if (local && m->window > 0) { /* each sequence's view, the same in every sliding-window layer */
        p->windows = calloc((size_t)n_seq, sizeof(Window));
        if (!p->windows) return pass_free(p), -1;
        for (int s = 0; s < n_seq; s++)
            if (window_of(&seqs[s], m->window, &p->windows[s]) != 0) return pass_free(p), -1;
    }
    return 0;
}

/* Layer i's attention half: x += (the previous layer's MLP output), normalised; q, k, v; rotary
 * embedding and cache writes; attention; its output projection, into buf[O]. */
static void attention_half(const Model *m, const Layer *l, int i, Pass *p, void *x, const void *pending,
                           const float *freqs, const Sequence *seqs, int threads) {
    size_t es = (size_t)m->element_size, r = (size_t)p->rows;
    int rows = p->rows;
    float eps = (float)m->eps, scale = (float)m->scale;
    char **buf = p->buf;
    const Window *w = l->local ? p->windows : NULL; /* per sequence: w + s */
    m->add_rms_norm(x, pending, l->attn_norm, buf[H], rows, (int)m->hidden, eps);
    if (l->k.fn) {
        char *q = buf[PARTS], *k = q + r * p->q_width * es, *v = k + r * p->kv_width * es;
        project(&l->qkv, buf[H], q, rows, threads);
        project(&l->k, buf[H], k, rows, threads);
        project(&l->v, buf[H], v, rows, threads);
        join_qkv(q, k, v, buf[QKV], rows, p->q_width, p->kv_width, es);
    } else {
        project(&l->qkv, buf[H], buf[QKV], rows, threads);
    }
    if (l->q_norm) /* per head, in place (each row's q heads, then its k heads) */
        for (int row = 0; row < rows; row++) {
            char *at = buf[QKV] + (size_t)row * p->qkv_width * es;
            m->add_rms_norm(at, NULL, l->q_norm, at, (int)m->n_heads, (int)m->head_dim, eps);
            m->add_rms_norm(at + p->q_width * es, NULL, l->k_norm, at + p->q_width * es, (int)m->n_kv_heads,
                            (int)m->head_dim, eps);
        }
    const float *table = l->freqs ? l->freqs : freqs;
    /* one sequence: its attention splits over the threads; several: a sequence of many rows (a
     * prompt's chunk) takes the threads on its own, so that its rows share the reading of its cache
     * (attention.c's blocks of rows), and the other rows split over the threads in one parallel
     * region a layer (not one per sequence). A query's result is the same either way. */
    if (p->n_seq == 1) {
        sequence_rope(m, &seqs[0], 0, i, buf[QKV], buf[Q], table);
        sequence_attention(m, &seqs[0], w, 0, 0, (int)seqs[0].rows, i, buf[Q], buf[HEADS], scale, threads);
    } else {
        for (int s = 0; s < p->n_seq; s++) sequence_rope(m, &seqs[s], (size_t)p->starts[s], i, buf[QKV], buf[Q], table);
        for (int s = 0; s < p->n_seq; s++)
            if (seqs[s].rows >= MANY_ROWS)
                sequence_attention(m, &seqs[s], w ? w + s : NULL, (size_t)p->starts[s], 0, (int)seqs[s].rows, i,
                                   buf[Q], buf[HEADS], scale, threads);
        _Pragma("omp parallel num_threads(threads) if (threads > 1)")
        {
            flush_denormals();
            _Pragma("omp for schedule(dynamic)")
            for (int row = 0; row < rows; row++) {
                int s = p->row_sequence[row];
                if (seqs[s].rows >= MANY_ROWS) continue;
                sequence_attention(m, &seqs[s], w ? w + s : NULL, (size_t)p->starts[s], row - (int)p->starts[s], 1,
                                   i, buf[Q], buf[HEADS], scale, 1);
            }
        }
    }
    if (es == 2) /* rounded to bfloat16 as torch's .to() rounds (q_width is a multiple of 16) */
        for (size_t j = 0; j < r * p->q_width; j += 16)
            store_bf16((uint16_t *)buf[ATTN] + j, _mm512_loadu_ps((const float *)buf[HEADS] + j));
    project(&l->o, buf[ATTN], buf[O], rows, threads);
    if (l->post_attn_norm) m->add_rms_norm(buf[O], NULL, l->post_attn_norm, buf[O], rows, (int)m->hidden, eps);
}

/* Layer i's MLP half: x += buf[O], normalised; gate and up; their gating; down, into pending. */
static void mlp_half(const Model *m, const Layer *l, Pass *p, void *x, void *pending, int threads) {
    int rows = p->rows, hidden = (int)m->hidden;
    float eps = (float)m->eps;
    char **buf = p->buf;
    m->add_rms_norm(x, buf[O], l->mlp_norm, buf[H], rows, hidden, eps);
    project(&l->gate_up, buf[H], buf[GATE_UP], rows, threads);
    m->gate_mul(buf[GATE_UP], buf[ACT], rows, (int)m->inter);
    project(&l->down, buf[ACT], pending, rows, threads);
    if (l->post_mlp_norm) m->add_rms_norm(pending, NULL, l->post_mlp_norm, pending, rows, hidden, eps);
}

/* Run the first `n_layers` layers, except those flagged in `skip` (NULL: none), on the rows of
 * `n_seq` sequences stacked in x [rows, hidden]; pending: [rows, hidden], receives the last
 * layer's MLP output. freqs: rotary (cos, sin) pairs [max_position, head_dim]. Projections,
 * norms and gating take all rows at once (every row computed on its own); rotary embedding,
 * cache writes and attention run per sequence on its own cache, so a sequence's results are the
 * same alone or beside others (a skipped layer's cache is left alone). Returns how many layers
 * ran, or -1 when scratch memory cannot be allocated. */
int decodekit_decoder_layers_batch(const Model *m, const Layer *layers, int n_layers, const uint8_t *skip, void *x,
                                   void *pending, const float *freqs, const Sequence *seqs, int n_seq, int threads) {
    Pass pass;
    if (pass_alloc(&pass, m, layers, n_layers, seqs, n_seq) != 0) return -1;
    int ran = 0;
    for (int i = 0; i < n_layers; i++) {
        if (skip && skip[i]) continue; /* its input goes on to the next layer, pending included */
        attention_half(m, &layers[i], i, &pass, x, ran ? pending : NULL, freqs, seqs, threads);
        mlp_half(m, &layers[i], &pass, x, pending, threads);
        ran++;
    }
    pass_free(&pass);
    return ran;
}

void decodekit_struct_sizes(int64_t *out) {
    out[0] = sizeof(Projection), out[1] = sizeof(Layer), out[2] = sizeof(Model);
    out[3] = sizeof(KiviCodes), out[4] = sizeof(Sequence);
}
