/* GGUF block helpers shared by the float32 (gemm.c) and integer (gemm_q8.c) block kernels. */
#ifndef DECODEKIT_GGUF_H
#define DECODEKIT_GGUF_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Bytes of one block of each GGUF type the kernels read, and the weights it holds (the
 * table gguf_blocks.py's BLOCK_BYTES and BLOCK_WEIGHTS hold too: a test compares them). */
#define Q4_1_BYTES 20  /* fp16 scale, fp16 minimum, 16 bytes of nibbles */
#define Q8_0_BYTES 34  /* fp16 scale, 32 int8 */
#define Q5_0_BYTES 22  /* fp16 scale, 4 bytes of fifth bits, 16 bytes of nibbles */
#define Q4_K_BYTES 144
#define Q5_K_BYTES 176
#define Q6_K_BYTES 210
#define SMALL_BLOCK_WEIGHTS 32  /* Q4_1, Q8_0, Q5_0 */
#define K_BLOCK_WEIGHTS 256     /* the K-quants */

/* A float16 value stored at p (exact in float32). */
static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Sub-block j's 6-bit scale and minimum from a Q4_K / Q5_K block's 12 packed bytes q (ggml's
 * get_scale_min_k4). */
static inline void k_scale_min(const uint8_t *q, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63, *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#endif
