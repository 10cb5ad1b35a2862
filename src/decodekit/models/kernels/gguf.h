/* GGUF block helpers shared by the float32 (gemm.c) and integer (gemm_q8.c) block kernels. */
#ifndef DECODEKIT_GGUF_H
#define DECODEKIT_GGUF_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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
