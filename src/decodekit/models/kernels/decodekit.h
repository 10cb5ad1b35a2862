/* decodekit's C kernels: every exported function, and the structures of the decoder-layers call.
 *
 * Each .c file is compiled into a library of its own and includes this header, so the compiler
 * checks every definition against its declaration here. Python calls them through ctypes
 * (the Python modules beside it, whose argtypes and structures follow these declarations); `forward.c` calls the
 * matrix, layer and attention kernels through the type-erased pointers at the end.
 *
 * Conventions: matrices are row-major; `rows` (or `M`, `n_q`) inputs or queries; `threads` OpenMP
 * threads (1: none started). Every row's result is computed the same way whatever the other rows
 * of the call are, so a row's output does not depend on what else is in the pass.
 */
#ifndef DECODEKIT_H
#define DECODEKIT_H
#include <stdint.h>

/* gemm.c: y[M, n_out] = x[M, n_in] w[n_out, n_in]^T, w float32, bfloat16 or GGUF blocks rebuilt in
 * float32 in registers (the x4 formats: four rows' blocks interleaved). The `exact` numerics. */
void decodekit_gemm_f32(const float *w, const float *x, float *y, int M, int n_out, int n_in, int threads);
void decodekit_gemm_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int M, int n_out, int n_in, int threads);
#define DECODEKIT_BLOCK_GEMM(F) \
    void decodekit_gemm_##F(const uint8_t *w, const float *x, float *y, int M, int n_out, int n_in, int threads)
DECODEKIT_BLOCK_GEMM(q4_1);
DECODEKIT_BLOCK_GEMM(q8_0);
DECODEKIT_BLOCK_GEMM(q5_0);
DECODEKIT_BLOCK_GEMM(q4_k);
DECODEKIT_BLOCK_GEMM(q5_k);
DECODEKIT_BLOCK_GEMM(q6_k);
DECODEKIT_BLOCK_GEMM(q4_1x4);
DECODEKIT_BLOCK_GEMM(q8_0x4);
DECODEKIT_BLOCK_GEMM(q5_0x4);
DECODEKIT_BLOCK_GEMM(q4_kx4);
DECODEKIT_BLOCK_GEMM(q5_kx4);
DECODEKIT_BLOCK_GEMM(q6_kx4);
int decodekit_has_avx512bf16(void);

/* gemm_q8.c: GGUF blocks repacked once (`decodekit_q8_pack`; kind: one of the kinds below, as
 * INTEGER_KINDS in matmul.py) times inputs quantised to 8 bits per block of 32, with integer dot products.
 * The `fast` numerics; decodekit_q8_reference is its scalar reference, bit for bit. */
enum { KIND_Q4_1, KIND_Q8_0, KIND_Q4_K, KIND_Q6_K, KIND_Q5_K, KIND_Q5_0, KINDS };
#define DECODEKIT_Q8_GROUP 16 /* output rows side by side in the packed layout (matmul.py's INTEGER_GROUP) */
int64_t decodekit_q8_packed_bytes(int kind, int n_out, int n_in);
void decodekit_q8_pack(int kind, const uint8_t *w, uint8_t *packed, int n_out, int n_in);
#define DECODEKIT_Q8_GEMM(F) \
    void decodekit_q8_##F(const uint8_t *packed, const float *x, float *y, int M, int n_out, int n_in, int threads)
DECODEKIT_Q8_GEMM(q4_1);
DECODEKIT_Q8_GEMM(q8_0);
DECODEKIT_Q8_GEMM(q4_k);
DECODEKIT_Q8_GEMM(q5_k);
DECODEKIT_Q8_GEMM(q6_k);
DECODEKIT_Q8_GEMM(q5_0);
void decodekit_q8_rows(int kind, const uint8_t *packed, const int64_t *rows, int n, int n_out, int n_in, float *out);
void decodekit_q8_reference(int kind, const uint8_t *w, const float *x, float *y, int M, int n_out, int n_in);
int64_t decodekit_q8_peak(int64_t iterations, int threads);
int decodekit_q8_runs_here(void);

/* attention.c: n_q queries [n_q, n_heads, head_dim] against the first n_keys of a cache
 * [n_kv_heads, cap, head_dim] (grouped-query heads), visible[n_q, n_keys] or NULL (every key). */
void decodekit_attention_f32(const float *q, const float *k, const float *v, const uint8_t *visible, float *out,
                             int n_q, int n_heads, int n_kv_heads, int head_dim, int cap, int n_keys, float scale,
                             int threads);
void decodekit_attention_bf16(const float *q, const uint16_t *k, const uint16_t *v, const uint8_t *visible,
                              float *out, int n_q, int n_heads, int n_kv_heads, int head_dim, int cap, int n_keys,
                              float scale, int threads);
/* The int8 cache: each entry's head_dim bytes followed by its float scale. */
void decodekit_attention_q8(const float *q, const int8_t *k, const int8_t *v, const uint8_t *visible, float *out,
                            int n_q, int n_heads, int n_kv_heads, int head_dim, int cap, int n_keys, float scale,
                            int threads);
/* How the float32 kernel would cut a pass into jobs: out = {jobs, pieces of the keys, blocks of rows,
 * shares of a group's heads, the busiest thread's rows x queries x keys}. */
void decodekit_attention_plan(int n_q, int n_heads, int n_kv_heads, int head_dim, int n_keys, const uint8_t *visible,
                              int threads, int64_t *out);
/* The KIVI cache: positions below qend[row] read from the 2- or 4-bit codes, the rest from the
 * float residual whose slot 0 holds position `base`. */
void decodekit_attention_kivi(const float *q, const uint8_t *k_codes, const float *k_params, const uint8_t *v_codes,
                              const float *v_params, const float *k_residual, const float *v_residual, const int32_t *qend,
                              const uint8_t *visible, float *out, int n_q, int n_heads, int n_kv_heads, int head_dim,
                              int group, int bits, int cap_q, int cap_residual, int base, int n_residual, float scale,
                              int threads);

/* layer_ops.c: a layer's element-wise work, float32 (f32) or bfloat16 (bf16) activations. */
void decodekit_add_rms_norm_f32(float *x, const float *delta, const float *weight, float *h, int rows, int dim,
                                float eps);
void decodekit_add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight, uint16_t *h, int rows,
                                 int dim, float eps);
void decodekit_silu_mul_f32(const float *gate_up, float *out, int rows, int inter);
void decodekit_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter);
void decodekit_gelu_mul_f32(const float *gate_up, float *out, int rows, int inter);
void decodekit_gelu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter);
void decodekit_rope_store_f32(const float *qkv, const float *freqs, const int64_t *positions, float *q_out,
                              float *k_cache, float *v_cache, int rows, int n_heads, int n_kv_heads, int head_dim,
                              int cap, int start);
void decodekit_rope_store_bf16(const uint16_t *qkv, const float *freqs, const int64_t *positions, float *q_out,
                               uint16_t *k_cache, uint16_t *v_cache, int rows, int n_heads, int n_kv_heads,
                               int head_dim, int cap, int start);
void decodekit_rope_store_q8(const float *qkv, const float *freqs, const int64_t *positions, float *q_out,
                             int8_t *k_cache, int8_t *v_cache, int rows, int n_heads, int n_kv_heads, int head_dim,
                             int cap, int start);

/* topk.c, token_mask.c, race.c: choosing tokens from logits. */
void decodekit_topk_f32(const float *x, int32_t *out, int rows, int n, int k);
int64_t decodekit_argmax_f32(const float *x, int64_t n);
void decodekit_mask_logits_f32(float *out, const float *in, const uint8_t *bits, int64_t n, int64_t known);
int64_t decodekit_masked_argmax_f32(const float *in, const uint8_t *bits, int64_t n, int64_t known);
double decodekit_race_uniform(uint64_t key, int64_t v);
int64_t decodekit_race_f32(const float *p, int64_t n, uint64_t key);
int decodekit_race_runs(void);

/* forward.c: every decoder layer of a pass in one call, through the kernels above, their element
 * types erased (void *: float32 or bfloat16 activations, a format's weights). */
typedef void (*gemm_fn)(const void *w, const void *x, void *y, int rows, int n_out, int n_in, int threads);
typedef void (*add_rms_norm_fn)(void *x, const void *delta, const void *weight, void *h, int rows, int dim, float eps);
typedef void (*gate_mul_fn)(const void *gate_up, void *out, int rows, int inter);
typedef void (*rope_store_fn)(const void *qkv, const float *freqs, const int64_t *positions, float *q_out,
                              void *k_cache, void *v_cache, int rows, int n_heads, int n_kv_heads, int head_dim,
                              int cap, int start);
typedef void (*attention_fn)(const float *q, const void *k, const void *v, const uint8_t *visible, float *out,
                             int n_q, int n_heads, int n_kv_heads, int head_dim, int cap, int n_keys, float scale,
                             int threads);
typedef void (*kivi_attention_fn)(const float *q, const uint8_t *k_codes, const float *k_params, const uint8_t *v_codes,
                                  const float *v_params, const float *k_residual, const float *v_residual,
                                  const int32_t *qend, const uint8_t *visible, float *out, int n_q, int n_heads,
                                  int n_kv_heads, int head_dim, int group, int bits, int cap_q, int cap_residual,
                                  int base, int n_residual, float scale, int threads);

/* Mirrored by ctypes structures in layers.py: keep the field order and types in step. */
typedef struct {
    gemm_fn fn;
    const void *weights;
    int64_t n_out, n_in;
} Projection;

typedef struct {
    const void *attn_norm, *mlp_norm;
    Projection qkv, o, gate_up, down;
    /* Gemma 3; zero for a Llama layer */
    Projection k, v;                  /* set: qkv holds q only, k and v are matrices of their own */
    const void *q_norm, *k_norm;      /* per-head RMSNorm weights of q and k, or NULL */
    const void *post_attn_norm, *post_mlp_norm; /* or NULL */
    const float *freqs;               /* this layer's rotary table, or NULL for the pass's */
    int64_t local;                    /* 1: attends to the last Model.window positions only */
} Layer;

typedef struct {
    add_rms_norm_fn add_rms_norm;
    gate_mul_fn gate_mul;
    rope_store_fn rope_store;
    attention_fn attention;
    int64_t hidden, inter, n_heads, n_kv_heads, head_dim;
    int64_t element_size; /* 4: float32 activations and cache, 2: bfloat16 */
    double eps, scale;
    int64_t window; /* the sliding window of local layers */
} Model;

/* A sequence's KIVI codes (kv caches "int4", "int2": decodekit_attention_kivi): layer 0's arrays
 * and each one's stride between layers, in elements; the sequence's float cache is then the
 * residual, its slot 0 holding position `base`. qend: per row, the positions below it are read
 * from the codes. */
typedef struct {
    kivi_attention_fn attention;
    const uint8_t *k_codes, *v_codes;
    const float *k_params, *v_params;
    int64_t codes_stride, k_params_stride, v_params_stride;
    int64_t group, bits, cap_q, base;
    const int32_t *qend;
} KiviCodes;

/* One sequence's part of a pass: `rows` consecutive rows of x, at cache slots start.. of its own
 * cache (positions as given). visible: [rows, start + rows] bytes, or NULL for "every cached
 * key". k_cache, v_cache: layer 0's [n_kv_heads, cap, head_dim] cache, layer_stride elements
 * apart. */
typedef struct {
    int64_t rows, start, cap, layer_stride;
    const int64_t *positions;
    const uint8_t *visible;
    void *k_cache, *v_cache;
    const KiviCodes *kivi; /* or NULL: the cache holds every key and value */
} Sequence;

/* The first n_layers layers (those flagged in skip skipped) over the rows of n_seq sequences
 * stacked in x [rows, hidden] (see forward.c); how many layers ran, or -1 when scratch memory
 * cannot be allocated. */
int decodekit_decoder_layers_batch(const Model *m, const Layer *layers, int n_layers, const uint8_t *skip, void *x,
                                   void *pending, const float *freqs, const Sequence *seqs, int n_seq, int threads);

/* sizeof Projection, Layer, Model, KiviCodes and Sequence, in that order, into out[0..5): what
 * the ctypes mirrors are checked against when the library loads. */
void decodekit_struct_sizes(int64_t *out);

#endif
